"""The steps of `kgen selftest`, in the order they run, each with its time budget on one H100/H200.
The budgets add up to 8 minutes; a step that reaches its budget stops (the timing steps keep the
shapes they measured) and the run goes on with the next. The GPU budgets are estimates: no GPU has
run them yet (the report gives each step's seconds beside its budget)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kgen.selftest import environment, external, specs, timing
from kgen.selftest.outcome import Context, Outcome

GPU_TOTAL_S = 480  # the whole run on one H100/H200


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    gpu_budget_s: int  # on one H100/H200 (a hard limit there)
    cpu_budget_s: int  # with --backend cpu (a hard limit too; the CPU backend emulates every thread)
    run: Callable[[Context], Outcome]
    quick_note: str = ""  # what --quick leaves out of this step

    def budget(self, backend: str) -> int:
        return self.gpu_budget_s if backend == "cuda" else self.cpu_budget_s


STEPS = (
    Step("environment", "device, driver and versions", 20, 60, environment.environment),
    Step("specs", "every bundled spec built and verified on the device, each body it can run", 140, 900,
         specs.build_and_verify,
         "one spec per kind (kgen.selftest.specs.QUICK_PICKS), and only the body of each spec as written"),
    Step("vllm", "vLLM serving with kgen in place of its attention, against vLLM's own (python -m "
         "kgen.vllm.compare MODEL --gpu; --dry-run on the CPU backend)", 140, 900, external.vllm_comparison),
    Step("decode", "decode timed against FlashInfer and torch SDPA", 45, 300, timing.decode,
         "three of the twelve batch x context shapes on a GPU"),
    Step("prefill", "prefill timed against FlashInfer and torch SDPA", 55, 400, timing.prefill,
         "on a GPU one spec (llama3_8b_prefill, GQA 4) at three shapes; on the CPU one small mixed batch"),
    Step("gpu-tests", "the gpu-marked tests (pytest -m gpu)", 80, 120, external.gpu_tests),
)
BY_NAME = {s.name: s for s in STEPS}
assert sum(s.gpu_budget_s for s in STEPS) <= GPU_TOTAL_S, "the GPU budgets must fit the 8-minute run"
