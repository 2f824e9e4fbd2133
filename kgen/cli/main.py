"""The `kgen` command group: one module per command group, registered here."""

from __future__ import annotations

import click

from kgen.cli.build import build
from kgen.cli.env import env
from kgen.cli.fib import fib
from kgen.cli.inspect import abi, schema, show, validate
from kgen.cli.models import specs_for_model_command
from kgen.cli.perf import perf
from kgen.cli.selftest import selftest
from kgen.cli.tune import report, tune
from kgen.cli.verify import verify


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kgen")
def main() -> None:
    """Generate, verify and tune specialized paged-attention CUDA kernels from YAML specs."""


for command in (build, validate, show, abi, verify, tune, report, schema, env, specs_for_model_command, fib, perf,
                selftest):
    main.add_command(command)
