"""`kgen env`: every environment variable kgen reads, its value and where the value came from; then
the KGEN_* names kgen reserves as C macros in kernel builds (not read from the environment)."""

from __future__ import annotations

import click
from rich.markup import escape

from kgen.cli.common import err, guard, out
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
    for problem in problems[:-1]:
        err.print(problem, markup=False)
    if problems:
        raise KgenUserError(problems[-1])
