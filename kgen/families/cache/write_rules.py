"""What every cache_write kind shares (the paged layouts' and the mla layout's): the host checks of
what the kernel trusts (slot_mapping, caller scales) and the conversion rule its rules text states."""

from __future__ import annotations

import numpy as np

from kgen.arrays import ArrayArg
from kgen.errors import ArgumentError
from kgen.families.binding import host_values
from kgen.formats.cache import CacheFormat


def check_slots_and_scales(spec, sm: ArrayArg, scales: list[ArrayArg | None], num_blocks: int) -> None:
    """Host checks of what the kernel trusts: slots in range and distinct, caller scales usable."""
    slots = host_values(sm)
    cap = num_blocks * spec.kv_cache.block_size
    bad = np.nonzero((slots < -1) | (slots >= cap))[0]
    if bad.size:
        i = int(bad[0])
        raise ArgumentError(f"slot_mapping[{i}] = {int(slots[i])}: not a slot of the pool (-1 to skip, or "
                            f"0..{cap - 1} = num_blocks {num_blocks} × block_size {spec.kv_cache.block_size})")
    used = slots[slots >= 0]
    values, first, counts = np.unique(used, return_index=True, return_counts=True)
    if (counts > 1).any():
        dup = int(values[np.argmax(counts > 1)])
        where = np.nonzero(slots == dup)[0][:2]
        raise ArgumentError(f"slot_mapping[{int(where[0])}] and slot_mapping[{int(where[1])}] are both slot {dup}: "
                            "two tokens cannot be written to one slot in one call")
    if spec.kv_cache.scale in ("per_tensor", "per_head") or CacheFormat.of(spec).block_scaled:
        for s in scales:
            if s.dtype != "fp32":
                continue  # nvfp4's block scales: written by the kernel
            vals = np.atleast_1d(host_values(s))
            wrong = np.nonzero(~(np.isfinite(vals) & (vals > 0)))[0]
            if wrong.size:
                j = int(wrong[0])
                at = "" if s.shape == () else f"[{j}]"
                raise ArgumentError(f"{s.name}{at} = {float(vals[j])!r}: scales must be positive and finite "
                                    "(stored = real / scale)")


def conversion_rule(name: str) -> str:
    """The conversion a cache_write applies to a value of cache dtype `name`, as its rules text states it."""
    if name == "nvfp4":
        return ("per 16-element group g (fp32, round to nearest even): s_g = e4m3_sat(max|x| / (6 * tensor_scale)), "
                "nibble = e2m1_sat(x / (s_g * tensor_scale)) (-0 kept, NaN -> +0, s_g = 0 -> 0); "
                "kgen/formats/nvfp4.py")
    if name == "int8":
        return "int8 = rint_half_even(clamp(x / scale, -127, 127)) (NaN -> 0); QMAX 127"
    if name.startswith("fp8"):
        qmax = 448 if name == "fp8_e4m3" else 57344
        return f"{name} = round-nearest-even(x / scale) saturated to ±{qmax} (__NV_SATFINITE); QMAX {qmax}"
    return f"{name} = round-nearest-even(x) (same dtype: copied)"
