"""REPORT.md and selftest.json: every figure of the run, the device, driver and versions, and each
step's status (passed / failed / skipped, with the reason), seconds and budget."""

from __future__ import annotations

import json
import math
from pathlib import Path

from kgen.bench import decode as bd
from kgen.bench import prefill as bp
from kgen.selftest.steps import GPU_TOTAL_S, STEPS
from kgen.version import __version__

SCHEMA = "kgen-selftest/1"
MARK = {"passed": "passed", "failed": "**FAILED**", "skipped": "skipped"}


def document(results: list[dict], backend: str, quick: bool, started: str, seconds: float, code: int) -> dict:
    """The JSON document: the run, the environment's facts, every step's result."""
    env = next((r["figures"] for r in results if r["name"] == "environment"), {})
    return {"schema": SCHEMA, "kgen": __version__, "started": started, "seconds": round(seconds, 1),
            "backend": backend, "quick": quick, "exit_status": code, "environment": env,
            "gpu_budget_s": {s.name: s.gpu_budget_s for s in STEPS}, "gpu_total_s": GPU_TOTAL_S,
            "quick_leaves_out": {s.name: s.quick_note for s in STEPS if s.quick_note} if quick else {},
            "steps": results}


def md_table(head: list[str], rows: list[list]) -> str:
    esc = lambda x: str(x).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(esc(c) for c in row) + " |" for row in rows)])


def _specs(f: dict) -> list[str]:
    rows = [[r["spec"], r["body"], MARK.get(r["status"], r["status"]), r.get("cases", ""),
             r.get("summary") or r.get("reason", ""), f"{r.get('seconds', 0):.1f}",
             "; ".join(f"{a}: {v['registers']} regs, {v['spills']} spills" for a, v in r.get("resources", {}).items()),
             "; ".join(r.get("notes", []))] for r in f.get("bodies", [])]
    return [f"Bodies for {f.get('arch', '?')} on the {f.get('backend', '?')} backend (seed {f.get('seed', '?')}), "
            f"{f.get('specs', 0)} spec files:", "",
            md_table(["spec", "body", "result", "cases", "verification", "s", "ptxas", "kgen's notes"], rows)]


def _untimed_table(rows: list[dict], shape) -> str:
    return md_table(["spec", "path", "shape", "max abs kgen - SDPA"],
                    [[r["spec"], r["path"], shape(r), r.get("skipped") or
                      (f"{r['max_abs_kgen_vs_sdpa']:.2e}" if "max_abs_kgen_vs_sdpa" in r else "n/a")] for r in rows])


def _decode(f: dict) -> list[str]:
    rows = f.get("rows", [])
    if not f.get("timed"):
        return ["No timings on the CPU backend (its times are not GPU figures): kgen against SDPA only.", "",
                _untimed_table(rows, lambda r: f"{r['batch']}x{r['context']}")]
    copy_bw = f.get("copy_bw", math.nan)
    return [f"Measured on {f.get('device')} (copy bandwidth {copy_bw / 1e9:.0f} GB/s). SDPA/kgen and FI/kgen above 1: "
            "kgen is faster.", "", bd.table(rows, copy_bw)]


def _prefill(f: dict) -> list[str]:
    rows = f.get("rows", [])
    if not f.get("timed"):
        return ["No timings on the CPU backend (its times are not GPU figures): kgen against SDPA only.", "",
                _untimed_table(rows, lambda r: f"GQA {r.get('gqa')} {r['shape']}")]
    return [f"Measured on {f.get('device')}. TFLOP/s of the causal FLOP; 'of peak' of {bp.PEAK / 1e12:.1f} TFLOP/s "
            "dense fp16; FI/kgen and SDPA/kgen above 1: kgen is faster.", "",
            bp.table(rows, f.get("backends", [])), "", *f.get("mixed", [])]


def _vllm(f: dict) -> list[str]:
    lines = [f"`{f.get('command', '')}`" if f.get("command") else ""]
    lines += ["```", *f.get("summary", []), "```"] if f.get("summary") else []
    return lines


def _gpu_tests(f: dict) -> list[str]:
    if not f:
        return []
    return [f"pytest: {f.get('summary') or 'no summary line'}; counts {f.get('counts', {})}",
            *(f"- FAILED {t}" for t in f.get("failed", []))]


def _environment(f: dict) -> list[str]:
    return [md_table(["", ""], [[k, json.dumps(v) if isinstance(v, dict) else v] for k, v in f.items()])]


RENDER = {"environment": _environment, "specs": _specs, "vllm": _vllm, "decode": _decode, "prefill": _prefill,
          "gpu-tests": _gpu_tests}


def markdown(doc: dict) -> str:
    env = doc["environment"]
    device = env.get("device", {})
    if isinstance(device, dict):
        device = f"{device.get('name')} ({device.get('arch')})"
    else:  # no GPU, or facts that could not be read: the environment section has the whole text
        device = "none (no GPU visible)" if str(device).startswith("none") else str(device)[:100]
    verdict = {0: "every step that ran passed", 1: "a step failed"}[doc["exit_status"]]
    out = [f"# kgen selftest: {verdict}", "",
           f"kgen {doc['kgen']}, backend {doc['backend']}{' --quick' if doc['quick'] else ''}, device {device}, "
           f"started {doc['started']}, {doc['seconds']:.0f} s in all, exit status {doc['exit_status']}.", "",
           "## Steps", "",
           md_table(["step", "status", "seconds", "budget s", "reason"],
                    [[r["name"], MARK.get(r["status"], r["status"]), f"{r['seconds']:.1f}", r["budget_s"], r["reason"]]
                     for r in doc["steps"]]), "",
           f"Budgets on one H100/H200 (a hard limit per step; {doc['gpu_total_s']} s in all): "
           + ", ".join(f"{k} {v} s" for k, v in doc["gpu_budget_s"].items()) + "."]
    if doc["quick"]:
        out += ["", "What --quick leaves out: " + "; ".join(f"{k}: {v}" for k, v in doc["quick_leaves_out"].items())
                + "; and on the CPU backend every timing (its times are not GPU figures)."]
    for r in doc["steps"]:
        out += ["", f"## {r['name']}: {r['title']}", "", f"{MARK.get(r['status'], r['status'])}"
                + (f": {r['reason']}" if r["reason"] else "") + f" ({r['seconds']:.1f} s; log {r['log']})", ""]
        try:
            out += RENDER.get(r["name"], lambda f: [])(r["figures"])
        except Exception as e:  # noqa: BLE001 (the figures are in selftest.json whatever happens here)
            out += [f"(these figures could not be rendered: {type(e).__name__}: {e}; selftest.json has them)"]
    return "\n".join(out) + "\n"


def write(out_dir: Path, doc: dict) -> tuple[Path, Path]:
    report, data = out_dir / "REPORT.md", out_dir / "selftest.json"
    data.write_text(json.dumps(doc, indent=1, default=str))
    report.write_text(markdown(doc))
    return report, data
