"""The `kgen` command line. Exit codes: 0 ok, 1 a kernel failed (verification or
compilation), 2 bad input (spec, arguments, missing tool). User mistakes never
print a traceback."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from .errors import CompileError, KernelRuntimeError, KgenUserError, SpecError, ToolchainError

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


class Failed(Exception):
    """A kernel failed verification or compilation: exit 1 after reporting."""


def _guard(fn):
    """Map kgen's error classes to messages and exit codes."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (KgenUserError, ToolchainError) as e:
            err.print(str(e), markup=False)
            sys.exit(EXIT_BAD_INPUT)
        except (CompileError, KernelRuntimeError) as e:
            err.print(str(e), markup=False)
            sys.exit(EXIT_FAILED)
        except Failed as e:
            if str(e):
                err.print(str(e), markup=False)
            sys.exit(EXIT_FAILED)

    return wrapper


def load_specs(paths: tuple[str, ...]):
    """Load every spec; report every error of every file at once (SpecError)."""
    from .families import support_problems
    from .spec import load_spec

    specs, errors = [], []
    for path in paths:
        try:
            spec = load_spec(path)
        except SpecError as e:
            errors.extend(e.errors)
            continue
        errors.extend(f"{path}:1: {p}" for p in support_problems(spec))
        specs.append(spec)
    names: dict[str, str] = {}
    for spec, path in zip(specs, paths, strict=False):
        if spec.name in names:
            errors.append(f"{path}:1: name: '{spec.name}' is also the name of {names[spec.name]} "
                          "(names must be unique within one build)")
        names.setdefault(spec.name, str(spec.source_path))
    if errors:
        raise SpecError(errors)
    return specs


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kgen")
def main() -> None:
    """Generate, verify and tune specialized paged-attention CUDA kernels from YAML specs."""


@main.command()
@click.argument("specs", nargs=-1, required=True)
@click.option("-o", "--output", default="generated", show_default=True, help="directory for generated/<name>/")
@click.option("--arch", "archs", multiple=True, help="CUDA arch(s) to compile for (default: the spec's targets)")
@click.option("--backend", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--tune", is_flag=True, help="autotune the spec's tuning space before writing")
@click.option("--seed", type=int, default=None, help="verification seed (default: fresh)")
@_guard
def build(specs, output, archs, backend, tune, seed):
    """Build, verify and write generated/<name>/ for each SPEC."""
    from rich.progress import Progress

    from .build import build as build_kernel
    from .generated import write_generated

    loaded = load_specs(specs)
    _check_archs(archs)
    failed = []
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("building", total=len(loaded))
        for spec in loaded:
            progress.update(task, description=f"{spec.name}: render, compile, verify")
            tuning = None
            config = None
            if tune:
                from .tune import tune_spec

                tuning = tune_spec(spec, backend=backend)
                config = tuning.get("default_winner")
            try:
                kernel = build_kernel(spec, backend=backend, verify=True, config=config,
                                      archs=list(archs) or None, seed=seed)
            except CompileError as e:
                err.print(str(e), markup=False)
                failed.append(spec.name)
                progress.advance(task)
                continue
            line = kernel.report.summary()
            regs = ", ".join(f"{arch}: {max(r['registers'] for r in res.values())} regs "
                             f"{max(r['spill_stores'] for r in res.values())} spills"
                             for arch, res in kernel.resources.items())
            if kernel.report.passed:
                path = write_generated(kernel, output, spec_file=str(spec.source_path), tuning=tuning)
                out.print(f"[green]ok[/green]   {escape(line)} {escape(f'[{regs}]')} -> {escape(str(path))}")
            else:
                out.print(f"[red]FAIL[/red] {escape(line)} (nothing written)")
                failed.append(spec.name)
            progress.advance(task)
    if failed:
        raise Failed(f"{len(failed)} kernel(s) failed: {', '.join(failed)}")


def _check_archs(archs) -> None:
    from .spec import ARCHS

    bad = [a for a in archs if a not in ARCHS]
    if bad:
        raise KgenUserError(f"--arch: {', '.join(bad)} not supported (allowed: {', '.join(ARCHS)})")


@main.command()
@click.argument("specs", nargs=-1, required=True)
@_guard
def validate(specs):
    """Schema and semantic checks only; nothing is compiled."""
    for spec in load_specs(specs):
        out.print(f"ok   {spec.source_path}: {spec.name} ({spec.kind})")


@main.command()
@click.argument("spec")
@click.option("--config", "config_items", multiple=True, metavar="NAME=VALUE", help="tuning parameter value")
@_guard
def show(spec, config_items):
    """Print the rendered CUDA source."""
    from .render import render

    (loaded,) = load_specs((spec,))
    click.echo(render(loaded, _parse_config(config_items)).source, nl=False)


def _parse_config(items) -> dict[str, int]:
    config = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            raise KgenUserError(f"--config: expected NAME=INTEGER, got {item!r}")
        config[name] = int(value)
    return config


@main.command()
@click.argument("spec")
@_guard
def abi(spec):
    """Print the kernel contract for a hand-written kernel."""
    from .abi import abi_text

    (loaded,) = load_specs((spec,))
    click.echo(abi_text(loaded), nl=False)


@main.command()
@click.argument("spec")
@click.option("--source", "source_file", type=click.Path(), default=None,
              help="verify this hand-written .cu file (the ABI of `kgen abi SPEC`) instead of kgen's kernel")
@click.option("--backend", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@_guard
def verify(spec, source_file, backend, seed, as_json):
    """Re-run the verification matrix with a fresh seed (or on a hand-written kernel)."""
    from .build import build as build_kernel
    from .verify import verify as run_verify

    (loaded,) = load_specs((spec,))
    if source_file is not None:
        from .handwritten import build_from_source

        kernel = build_from_source(loaded, Path(source_file), backend=backend)
    else:
        kernel = build_kernel(loaded, backend=backend, verify=False)
    report = run_verify(kernel, seed=seed)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _print_report(report)
    if not report.passed:
        raise Failed("")


def _print_report(report) -> None:
    from rich.table import Table

    table = Table(title=f"{report.spec_name} on {report.backend} (seed {report.seed})")
    for col in ("case", "seq_lens", "max error", "bound", "result"):
        table.add_column(col)
    for c in report.cases:
        lens = ",".join(map(str, c.seq_lens))
        lens = lens if len(lens) <= 40 else lens[:37] + "..."
        verdict = "[green]pass[/green]" if c.passed else f"[red]FAIL[/red] {escape(str(c.first_failure or ''))} {escape(c.note)}"
        table.add_row(escape(c.name), lens, f"{c.max_error:.3g}", f"{c.bound:.3g}", verdict)
    out.print(table)
    out.print(report.summary(), markup=False)


@main.command()
def schema():
    """Print the JSON Schema of spec files."""
    from .spec import json_schema

    click.echo(json.dumps(json_schema(), indent=2))


from .cli_tune import report, tune  # noqa: E402 - the tuning commands live in kgen/cli_tune.py

main.add_command(tune)
main.add_command(report)

if __name__ == "__main__":
    main()
