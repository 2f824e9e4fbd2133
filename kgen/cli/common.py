"""What every `kgen` command shares: the consoles, the error-to-exit-code mapping (0 ok, 1 a
kernel failed verification or compilation, 2 bad input; user mistakes never print a
traceback) and spec loading."""

from __future__ import annotations

import functools
import sys

import click
from rich.console import Console

from kgen.errors import (
    CompileError,
    KernelRuntimeError,
    KgenUserError,
    SpecError,
    ToolchainError,
)
from kgen.families.registry import support_problems
from kgen.spec.models import ARCHS, load_spec

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
SEED = click.IntRange(min=0)  # numpy's seeds are non-negative: refuse -1 at the option, not deep in a run


class Failed(Exception):
    """A kernel failed verification or compilation: exit 1 after reporting."""


def guard(fn):
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


def check_archs(archs) -> None:
    bad = [a for a in archs if a not in ARCHS]
    if bad:
        raise KgenUserError(f"--arch: {', '.join(bad)} not supported (allowed: {', '.join(ARCHS)})")


def parse_config(items) -> dict[str, int]:
    config = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            raise KgenUserError(f"--config: expected NAME=INTEGER, got {item!r}")
        config[name] = int(value)
    return config
