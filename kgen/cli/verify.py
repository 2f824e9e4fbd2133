"""`kgen verify`: re-run the case matrix on kgen's kernel or on a hand-written source."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from kgen.build import build as build_kernel
from kgen.cli.common import SEED, Failed, guard, load_specs, out
from kgen.cli.perf import (
    parse_margin,
    perf_report,
    require_speed_model,
    slower_cells,
    speed_beside_kgen,
)
from kgen.errors import CompileError, KgenUserError
from kgen.fib.convert import require_exportable, solution_name
from kgen.fib.trace import append_traces, case_traces, compile_error_trace
from kgen.verify.judge.report import describe_failure
from kgen.verify.runner import verify as run_verify
from kgen.verify.untrusted.handwritten import build_from_source


@click.command()
@click.argument("spec")
@click.option("--source", "source_file", type=click.Path(), default=None,
              help="verify this hand-written .cu file (the ABI of `kgen abi SPEC`) instead of kgen's kernel")
@click.option("--backend", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--seed", type=SEED, default=None)
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@click.option("--trace", "trace_file", type=click.Path(dir_okay=False), default=None,
              help="append one FlashInfer-Bench Trace per case to this JSONL file (docs/interop.md)")
@click.option("--require-speed", "speed_margin", is_flag=False, flag_value="10%", default=None, metavar="[MARGIN]",
              help="with --source: fail (exit 1) when the source's estimated speed is below kgen's kernel's by more "
                   "than MARGIN (default 10%) in a cell of the batch x context grid (`kgen perf`)")
@guard
def verify(spec, source_file, backend, seed, as_json, trace_file, speed_margin):
    """Re-run the verification matrix with a fresh seed (or on a hand-written kernel)."""
    (loaded,) = load_specs((spec,))
    margin = parse_margin(speed_margin) if speed_margin is not None else None
    if margin is not None and source_file is None:
        raise KgenUserError("--require-speed: compares a hand-written kernel with kgen's: give --source FILE.cu")
    if margin is not None:
        require_speed_model(loaded)  # the SASS tools and a decode spec, checked before anything runs
    if trace_file is not None:
        require_exportable(loaded)  # no trace can name a definition for this spec: refuse before running
    solution = Path(source_file).stem if source_file is not None else solution_name(loaded)
    try:
        if source_file is not None:
            kernel = build_from_source(loaded, Path(source_file), backend=backend)
        else:
            kernel = build_kernel(loaded, backend=backend, verify=False)
    except CompileError as e:
        if trace_file is not None:
            append_traces(Path(trace_file), [compile_error_trace(loaded, solution, str(e), backend)])
        raise
    report = run_verify(kernel, seed=seed)
    if trace_file is not None:
        append_traces(Path(trace_file), case_traces(report, loaded, solution))
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        print_report(report)
    slower = []
    if source_file is not None and not as_json:
        rep = speed_beside_kgen(loaded, source_file, margin)
        if rep is not None and margin is not None:
            kgen_grid, mine = rep["subjects"][0]["grid"], rep["subjects"][1]["grid"]
            slower = slower_cells(kgen_grid, mine, margin)
    elif margin is not None:  # --json: the comparison runs silently
        rep = perf_report(loaded, source_file, "sm_90")
        slower = slower_cells(rep["subjects"][0]["grid"], rep["subjects"][1]["grid"], margin)
    if not report.passed:
        raise Failed("")
    if slower:
        raise Failed(f"{source_file}: estimated slower than kgen's kernel (same ABI launch) by more than {margin:.0%} in "
                     f"{len(slower)} of {len(rep['subjects'][0]['grid'])} grid cells (sm_90 model): "
                     + "; ".join(slower))


def print_report(report) -> None:
    table = Table(title=f"{report.spec_name} on {report.backend} (seed {report.seed})")
    for col in ("case", "seq_lens", "max error", "bound", "result"):
        table.add_column(col)
    for c in report.cases:
        lens = ",".join(map(str, c.sizes))
        lens = lens if len(lens) <= 40 else lens[:37] + "..."
        verdict = "[green]pass[/green]" if c.passed else "[red]FAIL[/red]"
        table.add_row(escape(c.name), lens, f"{c.max_error:.3g}", f"{c.bound:.3g}", verdict)
    out.print(table)
    for c in report.failed_cases:  # where each failed case went wrong, one line each (not squeezed into a column)
        out.print(f"FAIL {c.name}: {describe_failure(c)}", markup=False)
    out.print(report.summary(), markup=False)
