"""`kgen env`: every environment variable kgen reads, its value and where the value came from; then
the KGEN_* names kgen reserves as C macros in kernel builds (not read from the environment); then the
CUDA line in use and what the driver supports (kgen/compile/cuda_line.py)."""

from __future__ import annotations

import click
from rich.markup import escape

from kgen.cli.common import err, guard, out
from kgen.compile import cuda_line
from kgen.compile.provided import RESERVED_MACROS
from kgen.errors import KgenUserError
from kgen.settings import report


@click.command()
@guard
def env():
    """List kgen's environment variables with their current values (exit 2 if one is invalid)."""
    problems = []
    for setting, value, source, problem in report():
        out.print(f"[bold]{setting.name}[/bold] = {escape(value)}  [dim]\\[{source}][/dim]")
        out.print(f"    {escape(setting.help)}; {escape(setting.expected())}")
        if problem:
            problems.append(problem)
    out.print("\n[bold]Reserved names[/bold] (C macros in kernel builds; not environment variables):")
    for name, meaning in RESERVED_MACROS.items():
        out.print(f"  {name}: {escape(meaning)}")
    _print_cuda_line(cuda_line.describe())
    for problem in problems[:-1]:
        err.print(problem, markup=False)
    if problems:
        raise KgenUserError(problems[-1])


def _print_cuda_line(info: dict) -> None:
    """The CUDA line section: a report, not a check (a machine without a driver is no error here)."""
    line = info["line"] or "none"
    default = " (the default)" if info["line"] == info["default_line"] else ""
    out.print(f"\n[bold]CUDA line[/bold]: {line}{default}" + (f", installed by {escape(info['extra'])}" if info["extra"]
                                                                else ""))
    for name, version in info["distributions"].items():
        out.print(f"  {name} {version}")
    out.print(f"  NVRTC: {info['nvrtc'] or 'none'}")
    driver = f"supports CUDA {info['driver']}" if info["driver"] else "none"
    out.print(f"  driver: {driver}  [dim]\\[{escape(info['driver_source'])}][/dim]")
    if info["driver"]:
        loads = ", ".join(info["loadable"]) or "nothing"
        out.print(f"  the driver loads this NVRTC's: {loads}; kgen emits: {info['target'] or 'nothing (refused)'}")
    for problem in info["problems"]:
        out.print(f"  [bold]problem[/bold]: {escape(problem)}")
