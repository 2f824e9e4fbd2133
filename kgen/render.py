"""Render a spec (+ a config of tuning parameters) into one CUDA C++ source.

The Jinja part is thin: typedefs and constexprs for the spec, the kernel's parameters as one
struct (`Params`, from the family's argument table) and the `__global__` entry that fills it and
calls the body. Kernel bodies live in real headers under templates/common/. The source is not
self-contained: besides CUDA's own fp16/bf16/fp8 headers it includes kgen's provided headers
(`#include "kgen/....cuh"`: platform, cp.async, conversions, the online softmax and split-KV merge,
mma, and every family's body as `kgen/bodies/<body>.cuh`; kgen/compile/provided.py), which both
compilers get from kgen and whose digest keys the compile caches with the source text. That is the
one way a body reaches a source, whatever the source policy needs of it (a body may branch on the
compiler; a hand-written source may not). Only values validated by the spec models reach the
template; StrictUndefined turns a missing template variable into an error instead of an empty string.

A spec renders once per arch (kgen/bodies.py): the family sees the arch alone as the spec's
targets, so each arch gets the best body it can run; the spec's hash in the source stays the whole
spec's, so archs that get the same body get the same source.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache

import jinja2

from kgen.bodies import newest, spec_for_arch
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
    notes: list[str] = field(default_factory=list)  # lines for the build report
    arch: str | None = None  # the arch this body was rendered for (None: a hand-written source)
    body: str = ""  # the family's name for the body (paged_prefill: "wgmma", "mma.sync", "fma"); "" where one
    why: str = ""  # why this arch got that body


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(spec, config: Config | None = None, arch: str | None = None) -> Rendered:
    """The source of `arch`'s body (None: the newest of the spec's targets, the default body)."""
    family = family_for(spec)
    arch = arch or newest(spec.targets)
    seen = spec_for_arch(spec, arch)  # the family decides this arch's body from this arch alone
    resolved = resolve_config(family, spec, config)
    problems = family.check_config(seen, resolved)
    if problems:
        raise KgenUserError("\n".join(f"{spec.name}: config {resolved} for target {arch}: {p}" for p in problems))
    kernels = family.kernels(seen, resolved)  # the argument table, built once for the template and the names
    context = family.template_context(seen, resolved, kernels)
    source = _environment().get_template(family.template).render(
        spec=spec,
        spec_hash=spec.spec_hash(),
        kgen_version=__version__,
        config_text=json.dumps(resolved, sort_keys=True),
        **context,
    )
    choice = family.body_choice(seen, resolved) if hasattr(family, "body_choice") else None
    body, why = choice or ("", "")
    return Rendered(source, [k.name for k in kernels], resolved, [], arch, body, why)
