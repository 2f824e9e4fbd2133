"""`kgen specs-for-model`: the spec set a Hugging Face model's attention needs, as YAML files."""

from __future__ import annotations

from pathlib import Path

import click
import yaml

from kgen.cli.common import guard, out
from kgen.fileio import atomic_write_text
from kgen.model_specs import KV_DTYPES, specs_for_model


@click.command("specs-for-model")
@click.argument("config", type=click.Path(dir_okay=True, path_type=Path))
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), default=Path("specs"),
              show_default=True, help="folder to write the YAML specs into")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES + ("fp8",)), default="auto", show_default=True,
              help="KV cache dtype (auto: the model's dtype)")
@click.option("--block-size", type=click.IntRange(1, 256), default=16, show_default=True)
@click.option("--dtype", type=click.Choice(("fp16", "bf16", "fp32")), default=None,
              help="query/output dtype (default: the config's torch_dtype)")
@guard
def specs_for_model_command(config, output, kv_dtype, block_size, dtype):
    """Write the cache_write, decode and prefill specs of each attention layer type of CONFIG (a
    config.json or the model folder holding it): what kgen's vLLM backend would derive."""
    specs = specs_for_model(config, kv_dtype=kv_dtype, block_size=block_size, dtype=dtype)  # all checked first
    output.mkdir(parents=True, exist_ok=True)
    for key, spec in specs.items():
        doc = spec.model_dump(mode="json", exclude_defaults=True, exclude_none=True)
        doc = {"kgen": 1, **{k: v for k, v in doc.items() if k != "kgen"}, "tail_masking": spec.tail_masking}
        path = atomic_write_text(output / f"{spec.name}.yaml", f"# {key}: derived by kgen specs-for-model from "
                                 f"{config}\n" + yaml.safe_dump(doc, sort_keys=False))
        out.print(f"wrote {path} ({key})")
