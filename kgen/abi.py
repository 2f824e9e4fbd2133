"""`kgen abi SPEC`: the kernel contract of one spec (docs/abi.md), produced from the family's
argument table: a C header comment (the specialised sizes, every argument with its role,
shape and dtype, the launch geometry), the includes the types need, and the exact
declarations: what to hand an engineer or an AI assistant writing a kernel by hand.
"""

from __future__ import annotations

from kgen.errors import KgenUserError
from kgen.families.argtable import abi_rows
from kgen.families.base import resolve_config
from kgen.families.registry import family_for
from kgen.formats.dtypes import dtype
from kgen.render import render

ABI_VERSION = 1
# What the declarations' types need: CUDA's number formats, and kgen's int8 element type.
PRELUDE = ("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n"
           "namespace kgen { typedef signed char i8; }\n")
# nvfp4 caches: kgen's packed pair type (templates/common/platform.cuh), one byte.
FP4_PRELUDE = "namespace kgen { enum class fp4x2 : unsigned char; }\n"


def abi_text(spec) -> str:
    family = family_for(spec)
    config = resolve_config(family, spec, family.abi_config(spec))
    kernels = family.kernels(spec, config)
    packed = dtype(spec.kv_cache.dtype).packed
    lines = [
        f"kgen ABI for spec '{spec.name}' (kind {spec.kind}, spec sha256 {spec.spec_hash()[:16]})",
        f"abi: {ABI_VERSION}",
        "",
        *family.abi_notes(spec),
        "",
        "Kernel parameters, in order (shapes and strides in elements" + ("; an nvfp4 cache's element is a byte, "
                                                                        "two e2m1 values" if packed else "")
        + "; roles: input/output arrays, kgen's scratch, scalar and stride values):",
        *abi_rows(kernels[0].params),  # the main kernel's parameters: the argument table
        "",
        f"Launch (as kgen does it; config {config}):",
        *(f"  {k.name}: {k.geometry()}" for k in kernels),
        *body_notes(spec),
    ]
    header = "/*\n" + "\n".join((" * " + line).rstrip() for line in lines) + "\n */\n"
    return header + PRELUDE + (FP4_PRELUDE if packed else "") + "\n".join(k.declaration() + ";" for k in kernels) + "\n"


def body_notes(spec) -> list[str]:
    """Which body kgen's own kernel (its default config) gives each target arch, and why; nothing
    for a family with one body. The hand-written launch above is the same on every arch."""
    lines = []
    for arch in spec.targets:
        try:
            rendered = render(spec, None, arch)
        except KgenUserError as e:
            lines.append(f"  {arch}: no body ({e})")
            continue
        if rendered.body:
            lines.append(f"  {arch}: {rendered.body} ({rendered.why})")
    if not lines:
        return []
    return ["", "kgen's own kernel, per target arch (its default config; the launch above is the hand-written "
                "one, the same on every arch):", *lines]
