"""Commands that look at a spec without running a kernel: validate, show, abi, schema."""

from __future__ import annotations

import json

import click

from kgen.abi import abi_text
from kgen.bodies import oldest
from kgen.cli.common import check_archs, guard, load_specs, out, parse_config
from kgen.compile.provided import editable_source
from kgen.render import render
from kgen.spec.models import json_schema


@click.command()
@click.argument("specs", nargs=-1, required=True)
@guard
def validate(specs):
    """Schema and semantic checks only; nothing is compiled."""
    for spec in load_specs(specs):
        out.print(f"ok   {spec.source_path}: {spec.name} ({spec.kind})")


@click.command()
@click.argument("spec")
@click.option("--config", "config_items", multiple=True, metavar="NAME=VALUE", help="tuning parameter value")
@click.option("--arch", default=None, help="the body this arch gets (default: the oldest of the spec's targets, "
              "the body every target compiles: what a hand-written source starts from)")
@guard
def show(spec, config_items, arch):
    """Print the rendered CUDA source (one arch's body), its kernel body pasted in where it is kernel code
    a hand-written source may hold (kgen/compile/provided.py editable_source)."""
    (loaded,) = load_specs((spec,))
    check_archs([arch] if arch else [])
    # A hand-written source is one body compiled for every target: start it from the one they all take.
    rendered = render(loaded, parse_config(config_items), arch or oldest(loaded.targets))
    click.echo(editable_source(rendered.source), nl=False)


@click.command()
@click.argument("spec")
@guard
def abi(spec):
    """Print the kernel contract for a hand-written kernel."""
    (loaded,) = load_specs((spec,))
    click.echo(abi_text(loaded), nl=False)


@click.command()
def schema():
    """Print the JSON Schema of spec files."""
    click.echo(json.dumps(json_schema(), indent=2))
