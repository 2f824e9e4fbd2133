"""Render a spec (+ a config of tuning parameters) into one CUDA C++ source.

The Jinja part is thin: typedefs and constexprs for the spec. Kernel bodies live in real
headers under templates/common/. The source is not self-contained: besides CUDA's own
fp16/bf16/fp8 headers it includes kgen's provided headers (`#include "kgen/....cuh"`:
platform, cp.async, conversions, the online softmax and split-KV merge, mma and the prefill
body; kgen/compile/provided.py), which both compilers get from kgen and whose digest keys the
compile caches with the source text. A family's own body that needs no compiler branch
(decode, cache_write, copy_blocks) is inlined verbatim instead (`include_raw`, not parsed as
Jinja), so `kgen show` prints it as editable kernel code. Only values validated by the spec
models reach the template; StrictUndefined turns a missing template variable into an error
instead of an empty string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache

import jinja2

from kgen.errors import KgenUserError
from kgen.families.base import Config, resolve_config
from kgen.families.registry import family_for
from kgen.paths import templates_dir
from kgen.version import __version__


@dataclass(frozen=True)
class Rendered:
    source: str
    kernel_names: list[str]
    config: Config
    notes: list[str] = field(default_factory=list)  # the build report's lines about the body chosen


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    root = templates_dir()
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.globals["include_raw"] = lambda name: (root / name).read_text()
    return env


def render(spec, config: Config | None = None) -> Rendered:
    family = family_for(spec)
    resolved = resolve_config(family, spec, config)
    problems = family.check_config(spec, resolved)
    if problems:
        raise KgenUserError("\n".join(f"{spec.name}: config {resolved}: {p}" for p in problems))
    context = family.template_context(spec, resolved)
    source = _environment().get_template(family.template).render(
        spec=spec,
        spec_hash=spec.spec_hash(),
        kgen_version=__version__,
        config_text=json.dumps(resolved, sort_keys=True),
        **context,
    )
    notes = family.build_notes(spec, resolved) if hasattr(family, "build_notes") else []
    return Rendered(source, family.kernel_names(spec, resolved), resolved, notes)
