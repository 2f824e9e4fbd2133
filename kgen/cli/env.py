"""`kgen env`: every environment variable kgen reads, its value and where the value came from."""

from __future__ import annotations

import click
from rich.markup import escape

from kgen.cli.common import err, guard, out
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
    for problem in problems[:-1]:
        err.print(problem, markup=False)
    if problems:
        raise KgenUserError(problems[-1])
