"""`kgen verify`: re-run the case matrix on kgen's kernel or on a hand-written source."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from kgen.build import build as build_kernel
from kgen.cli.common import SEED, Failed, guard, load_specs, out
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
@guard
def verify(spec, source_file, backend, seed, as_json):
    """Re-run the verification matrix with a fresh seed (or on a hand-written kernel)."""
    (loaded,) = load_specs((spec,))
    if source_file is not None:
        kernel = build_from_source(loaded, Path(source_file), backend=backend)
    else:
        kernel = build_kernel(loaded, backend=backend, verify=False)
    report = run_verify(kernel, seed=seed)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        print_report(report)
    if not report.passed:
        raise Failed("")


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
