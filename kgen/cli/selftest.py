"""`kgen selftest`: the steps of kgen.selftest run in turn (each in its own process, within its
budget), then DIR/REPORT.md and DIR/selftest.json. Exit 0 when every step that ran passed, 1 when one
failed, 2 without a GPU unless --backend cpu."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import click
from rich.markup import escape

from kgen.cli.common import Failed, guard, load_specs, out
from kgen.errors import KgenUserError
from kgen.paths import source_checkout, specs_dir
from kgen.runtime.cuda import gpu_available, gpu_diagnosis
from kgen.selftest.outcome import Context
from kgen.selftest.report import document, write
from kgen.selftest.runner import exit_status, run
from kgen.selftest.steps import STEPS

COLOR = {"passed": "green", "failed": "red", "skipped": "yellow"}


@click.command()
@click.option("--backend", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cpu: the same steps on kgen's CPU backend, without timings (GPU-only steps are skipped)")
@click.option("--quick", is_flag=True, help="one spec per kind, fewer shapes; the report says what is left out")
@click.option("-o", "--output", default="selftest", show_default=True, help="directory for REPORT.md, selftest.json, logs/")
@click.option("--step", "steps", multiple=True, type=click.Choice([s.name for s in STEPS[1:]]),
              help="run only this step (repeatable, in the order given; the environment is always read first)")
@click.option("--spec", "spec_files", multiple=True, type=click.Path(dir_okay=False),
              help="build and verify these specs instead of the bundled ones (repeatable)")
@click.option("--model", type=click.Path(file_okay=False), default=None,
              help="the checkpoint folder the vLLM comparison serves (default: a tiny Llama written to DIR/model)")
@guard
def selftest(backend, quick, output, steps, spec_files, model):
    """Build and verify every bundled spec on this machine's GPU, run the GPU tests, time decode and
    prefill against FlashInfer and torch SDPA, compare kgen with vLLM's attention in vLLM; write
    DIR/REPORT.md and DIR/selftest.json. Within 8 minutes on one H100/H200."""
    if backend == "cuda" and not gpu_available():
        raise KgenUserError(f"kgen selftest: no usable CUDA GPU on this machine ({gpu_diagnosis()}); "
                            "`kgen selftest --backend cpu` runs the same steps on the CPU backend, without timings")
    out_dir = Path(output)
    if out_dir.exists() and not out_dir.is_dir():
        raise KgenUserError(f"-o {output}: exists and is not a directory")
    files = [str(Path(p).resolve()) for p in spec_files] or sorted(str(p) for p in specs_dir().glob("*.yaml"))
    load_specs(tuple(files))  # every spec valid before anything runs (exit 2 otherwise)
    if model is not None and not Path(model).is_dir():
        raise KgenUserError(f"--model {model}: no such directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = Context(backend=backend, quick=quick, out_dir=str(out_dir.resolve()), specs=files,
                  model=str(Path(model).resolve()) if model else None,
                  repo=str(source_checkout()) if source_checkout() else None)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    t0 = time.perf_counter()

    def progress(step, result):
        if result is None:
            out.print(f"{escape(step.name)}: {escape(step.title)} (budget {step.budget(backend)} s) ...")
            return
        color = COLOR.get(result["status"], "white")
        reason = f": {result['reason']}" if result["reason"] else ""
        out.print(f"  [{color}]{result['status']}[/{color}]{escape(reason)} ({result['seconds']:.1f} s)")

    results = run(ctx, list(steps) or None, progress)
    code = exit_status(results)
    report, data = write(out_dir, document(results, backend, quick, started, time.perf_counter() - t0, code))
    out.print(f"report: {escape(str(report))}, figures: {escape(str(data))}")
    if code:
        raise Failed(f"kgen selftest: failed steps: {', '.join(r['name'] for r in results if r['status'] == 'failed')}")
