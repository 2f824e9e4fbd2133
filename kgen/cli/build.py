"""`kgen build`: render, compile, verify and write generated/<name>/ for each spec; with
`--source FILE.cu`, the same from a hand-written kernel (verified isolated, like `kgen verify
--source`), for one spec."""

from __future__ import annotations

import click
from rich.markup import escape
from rich.progress import Progress

from kgen.build import body_lines
from kgen.build import build as build_kernel
from kgen.cli.common import SEED, Failed, check_archs, err, guard, load_specs, out
from kgen.errors import CompileError, KgenUserError, VerificationError
from kgen.generated import check_output, write_generated
from kgen.tune.runner import tune_spec
from kgen.verify.untrusted.handwritten import load_source


@click.command()
@click.argument("specs", nargs=-1, required=True)
@click.option("-o", "--output", default="generated", show_default=True, help="directory for generated/<name>/")
@click.option("--arch", "archs", multiple=True,
              help="CUDA arch(s) to build, each with its best body (default: the spec's targets)")
@click.option("--backend", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--tune", is_flag=True, help="autotune the spec's tuning space before writing")
@click.option("--seed", type=SEED, default=None, help="verification seed (default: fresh)")
@click.option("--force", is_flag=True,
              help="replace OUTPUT/<name> even when it is not kgen's own unchanged output (deletes what is there)")
@click.option("--source", "source_file", type=click.Path(), default=None,
              help="build this hand-written .cu file (the ABI of `kgen abi SPEC`, or `kgen show SPEC` edited) "
                   "instead of kgen's kernel; one SPEC; verified isolated first")
@guard
def build(specs, output, archs, backend, tune, seed, force, source_file):
    """Build, verify and write generated/<name>/ for each SPEC."""
    loaded = load_specs(specs)
    check_archs(archs)
    if not output:
        raise KgenUserError("-o: empty path (use -o . for the current directory)")
    if source_file is not None:
        if len(loaded) != 1:
            raise KgenUserError(f"--source: one SPEC with one hand-written source (got {len(loaded)} specs)")
        if tune:
            raise KgenUserError("--source: --tune searches kgen's own kernel's configs; a hand-written kernel "
                                "has one launch (leave out --tune)")
    check_output(output, [spec.name for spec in loaded], force)  # refuse before spending time on a build
    if source_file is not None:
        _build_source(loaded[0], source_file, output, archs, backend, seed, force)
        return
    failed = []
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("building", total=len(loaded))
        for spec in loaded:
            progress.update(task, description=f"{spec.name}: render, compile, verify")
            tuning = None
            config = None
            if tune:
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
            for body in body_lines(kernel):  # which body each arch got, and why
                out.print(f"body {escape(body)}")
            for note in getattr(kernel, "notes", []):
                out.print(f"note {escape(note)}")
            for adv in kernel.advisories:  # ptxas gave up performance somewhere: say where
                out.print(f"[yellow]ptxas[/yellow] {escape(adv['arch'])} {escape(adv['kernel'])}: "
                          f"{escape(adv['code'])} {escape(adv['message'])}")
            regs = ", ".join(f"{arch}: {max(r['registers'] for r in res.values())} regs "
                             f"{max(r['spill_stores'] for r in res.values())} spills"
                             f"{_advisory_count(arch, kernel.advisories)}"
                             for arch, res in kernel.resources.items())
            if kernel.report.passed:
                path = write_generated(kernel, output, spec_file=str(spec.source_path), tuning=tuning, force=force)
                out.print(f"[green]ok[/green]   {escape(line)} {escape(f'[{regs}]')} -> {escape(str(path))}")
            else:
                out.print(f"[red]FAIL[/red] {escape(line)} (nothing written)")
                failed.append(spec.name)
            progress.advance(task)
    if failed:
        raise Failed(f"{len(failed)} kernel(s) failed: {', '.join(failed)}")


def _build_source(spec, source_file: str, output: str, archs, backend: str, seed, force: bool) -> None:
    """Verify a hand-written source (isolated) and, when it passes, write OUTPUT/<name>/ from it."""
    with Progress(console=err, transient=True) as progress:
        progress.add_task(f"{spec.name}: verify {source_file} (isolated), build", total=None)
        try:
            kernel = load_source(spec, source_file, backend=backend, seed=seed, archs=list(archs) or None)
        except VerificationError as e:
            out.print(f"[red]FAIL[/red] {escape(str(e))} (nothing written)")
            raise Failed(f"1 kernel failed: {spec.name}") from None
    for adv in kernel.advisories:
        out.print(f"[yellow]ptxas[/yellow] {escape(adv['arch'])} {escape(adv['kernel'])}: "
                  f"{escape(adv['code'])} {escape(adv['message'])}")
    path = write_generated(kernel, output, spec_file=str(spec.source_path), force=force)
    out.print(f"[green]ok[/green]   {escape(kernel.report.summary())} from {escape(source_file)} "
              f"-> {escape(str(path))}")


def _advisory_count(arch: str, advisories: list[dict]) -> str:
    n = sum(a["arch"] == arch for a in advisories)
    return f" {n} ptxas advisor{'y' if n == 1 else 'ies'}" if n else ""
