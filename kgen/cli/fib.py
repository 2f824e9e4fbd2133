"""`kgen fib import` / `kgen fib export`: FlashInfer-Bench Definitions as kgen specs and back
(docs/interop.md §6). Bad input exits 2 with the reason and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import click
import yaml

from kgen.cli.common import guard, load_specs, out
from kgen.errors import KgenUserError
from kgen.fib.convert import (
    definition_to_spec,
    solution_name,
    spec_to_definition,
    spec_to_solution,
)
from kgen.fib.schema import Definition, parse
from kgen.fileio import atomic_write_text
from kgen.render import render


@click.group()
def fib() -> None:
    """FlashInfer-Bench interop: import a Definition as a spec, export a spec as a Definition and Solution."""


def read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KgenUserError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None


def spec_yaml(data: dict, header: str) -> str:
    return header + yaml.safe_dump(data, sort_keys=False)


@fib.command("import")
@click.argument("definition")
@click.option("-o", "--output", default=None, help="write the spec here (default: print it)")
@click.option("--sm-scale", type=float, default=None,
              help="the softmax scale to build for when the definition fixes none (MLA needs the model's)")
@guard
def import_(definition, output, sm_scale):
    """Write the kgen spec of a FlashInfer-Bench DEFINITION (gqa_paged or mla_paged, decode or prefill)."""
    d = parse(Definition, read_text(definition), definition)
    data = definition_to_spec(d, definition, sm_scale)
    scale = data["attention"]["softmax_scale"]
    text = spec_yaml(data, f"# FlashInfer-Bench definition {d.name} ({definition}), imported by `kgen fib import`.\n"
                           f"# sm_scale is a call argument there; this kernel is built for softmax_scale {scale}.\n")
    if output is None:
        click.echo(text, nl=False)
        return
    path = atomic_write_text(output, text)
    out.print(f"wrote {path} ({data['kind']}, from definition {d.name})", markup=False)


@fib.command("export")
@click.argument("spec")
@click.option("-o", "--output", required=True, help="folder: definitions/ and solutions/ in FlashInfer-Bench's layout")
@guard
def export(spec, output):
    """Write SPEC as a FlashInfer-Bench Definition and a Solution holding kgen's kernel source."""
    (loaded,) = load_specs((spec,))
    definition = spec_to_definition(loaded)  # refuses, before anything is written, what has no definition
    source = render(loaded).source
    solution = spec_to_solution(loaded, source, read_text(spec))
    root = Path(output)
    op_type = definition["op_type"]
    def_path = root / "definitions" / op_type / f"{definition['name']}.json"
    sol_path = root / "solutions" / op_type / definition["name"] / f"{solution_name(loaded)}.json"
    for path, doc in ((def_path, definition), (sol_path, solution)):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(doc, indent=2) + "\n")
        out.print(f"wrote {path}", markup=False)
