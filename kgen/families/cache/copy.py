"""The copy-blocks family: copy whole blocks src -> dst (copy-on-write, compaction) in every pool
array of the spec (K and V, or the fused pool; per_token_head scale pools too), for one
layer or for a list of layers in one launch (docs/cache-kernels.md, docs/abi.md).

Rules of a call (checked on the host, ArgumentError otherwise): ids in 0..num_blocks-1; no
dst twice; no block both a src and a dst (the copies run in parallel, so a chain like
1->2, 2->3 would have no defined order). A src may appear several times (forking a block).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kgen.arrays import ArrayArg, as_array_arg
from kgen.errors import ArgumentError
from kgen.families.argtable import Arg, KernelDecl, array
from kgen.families.base import Config, SingleKernelFamily
from kgen.families.binding import CallArg, CallBinder, host_values, refuse_plan
from kgen.families.cache import copy_cases as copy_blocks_cases
from kgen.formats.cache import (
    CacheFormat,
    cache_names,
    cache_rows,
    cache_shapes,
    describe,
    scale_dtype,
    scale_shape,
)


class CopyBlocksFamily(SingleKernelFamily):
    kind = "copy_blocks"
    template = "copy_blocks.cu.j2"

    def unsupported(self, spec) -> list[str]:
        return []

    def arguments(self, spec, config: Config) -> list[Arg]:
        return [
            array("planes", "int64", "input", ("num_planes", 3),
                  "{base address, block stride in bytes, block bytes} of each pool array of each layer"),
            array("pairs", "int32", "input", ("num_pairs", 2), "(src, dst) block ids"),
        ]

    def call_arguments(self, spec, config: Config) -> list[CallArg]:
        """The call takes the pool arrays (one, or a list with one per layer) and pairs; the plane
        table the kernel reads is built from them."""
        pools = [CallArg(n, spec.kv_cache.dtype, shape, "written", layers=True) for n, shape in cache_shapes(spec).items()]
        if CacheFormat.of(spec).scale_pools:
            pools += [CallArg(n, scale_dtype(spec), scale_shape(spec), "written", layers=True)
                      for n in ("k_scale", "v_scale")]
        return [*pools, CallArg("pairs", "int32", ("num_pairs", 2), "read")]

    def kernels(self, spec, config: Config) -> list[KernelDecl]:
        return [KernelDecl(spec.name, tuple(self.arguments(spec, config)), ("num_pairs", "num_planes", 1),
                           config["threads"])]

    def template_context(self, spec, config: Config, kernels: list[KernelDecl]) -> dict[str, Any]:
        return {"threads": config["threads"], "main": kernels[0]}

    def abi_notes(self, spec) -> list[str]:
        kv = spec.kv_cache
        names = [*cache_names(spec), *(("k_scale", "v_scale") if CacheFormat.of(spec).scale_pools else ())]
        lines = [
            f"block_size {kv.block_size}, cache {describe(spec)}, scale {kv.scale}",
            "",
            f"Call: kern({', '.join(names)}, pairs) -> None (copies in place). Each pool argument is one array or a "
            "list of arrays, one per layer, all the same shape; every layer is copied in one launch:",
            "  pairs         [n, 2]  int32 (src, dst) block ids in 0..num_blocks-1; no dst twice; no block both a "
            "src and a dst",
        ]
        lines += cache_rows(spec, "each block contiguous")
        if CacheFormat.of(spec).scale_pools:
            shape = ", ".join(str(s) for s in scale_shape(spec))
            what = "nvfp4 e4m3 block-scale" if CacheFormat.of(spec).block_scaled else "fp32 scale"
            lines.append(f"  k_scale, v_scale  [{shape}]  {what} pools (required: copied with the blocks)")
        return lines + ["", "The kernel sees one plane per (pool array, layer); 16-byte copies when aligned."]

    def bind(self, spec, config: Config, call: dict[str, Any], checked: bool = True, plan=None,
             target_blocks: int | None = None):
        """Check the call's arguments; return (launches, None): the copies are in place."""
        refuse_plan(spec, plan)
        return _bind(CallBinder(spec, call), self.kernels(spec, config)[0], checked)

    # ---- verification and benchmarks (kgen/families/cache/copy_cases.py) --------------------
    def cases(self, spec, config: Config, rng: np.random.Generator):
        return copy_blocks_cases.cases()

    def run_case(self, kernel, case, rng: np.random.Generator):
        return copy_blocks_cases.run_case(kernel, case, rng)

    def bucket_of(self, spec, call):
        """As bench() builds it: one sequence (batch 1) whose context is the blocks copied."""
        pairs = call.get("pairs")
        if pairs is None or len(pairs.shape) != 2:
            return None
        return 1, max(1, int(pairs.shape[0]) * spec.kv_cache.block_size)

    def bench(self, spec, config: Config, bucket, rng: np.random.Generator):
        return copy_blocks_cases.bench(spec, bucket, rng)


def _layers(b: CallBinder, name: str, required: bool) -> list[ArrayArg] | None:
    """One array, or a list/tuple of arrays (one per layer), as ArrayArgs named name[i]."""
    obj = b.call.pop(name, None)
    if obj is None:
        if required:
            raise ArgumentError(f"missing argument '{name}' (required by spec {b.spec.name})")
        return None
    if isinstance(obj, list | tuple):
        if not obj:
            raise ArgumentError(f"{name}: an empty list of layers")
        return [as_array_arg(f"{name}[{i}]", x) for i, x in enumerate(obj)]
    return [as_array_arg(name, obj)]


def _plane(arg: ArrayArg) -> tuple[int, int, int]:
    """(base address, block stride in bytes, block bytes); a block's elements must be contiguous."""
    inner = ArrayArg(arg.name, arg.obj, arg.shape[1:], arg.strides[1:], arg.dtype, arg.device, arg.ptr, None)
    if not inner.is_c_contiguous():
        raise ArgumentError(f"{arg.name}: each block must be contiguous (strides {list(arg.strides)}; only the "
                            "block stride may be padded)")
    return arg.ptr, arg.strides[0] * arg.itemsize, math.prod(arg.shape[1:]) * arg.itemsize


def _bind(b: CallBinder, kernel: KernelDecl, checked: bool):
    spec, kv = b.spec, b.spec.kv_cache
    pairs = b.take("pairs", True)
    b.device = pairs.device
    if len(pairs.shape) != 2 or pairs.shape[1] != 2:
        raise ArgumentError(f"pairs: expected shape [n, 2] (src, dst), got {list(pairs.shape)}")
    b.check(pairs, pairs.shape, "int32", contiguous=True)

    b.refuse_other_layouts()
    groups = {n: _layers(b, n, True) for n in cache_names(spec)}
    first = groups[cache_names(spec)[0]][0]
    N = first.shape[0] if first.shape else 0
    expected = cache_shapes(spec, N)
    for name in ("k_scale", "v_scale"):
        given = _layers(b, name, CacheFormat.of(spec).scale_pools)
        if given is None:
            continue
        if not CacheFormat.of(spec).scale_pools:
            raise ArgumentError(f"{name}: only per_token_head scale pools are per block; a cache with scale "
                                f"'{kv.scale}' takes no scales in copy_blocks")
        groups[name] = given
        expected[name] = scale_shape(spec, N)
    b.refuse_unknown()

    num_layers = len(next(iter(groups.values())))
    planes = []
    for name, arrays in groups.items():
        if len(arrays) != num_layers:
            raise ArgumentError(f"{name}: {len(arrays)} layer(s), but {cache_names(spec)[0]} has {num_layers}")
        for arr in arrays:
            b.check(arr, expected[name], scale_dtype(spec) if name.endswith("scale") else kv.dtype)
            planes.append(_plane(arr))
    b.refuse_aliasing([arr for arrays in groups.values() for arr in arrays], [pairs])

    if checked:
        _check_pairs(host_values(pairs), N)
    n = pairs.shape[0]
    if n == 0:
        return [], None
    table = _device_table(pairs, np.asarray(planes, dtype=np.int64))
    return [kernel.launch({"num_pairs": n, "num_planes": len(planes)}, {"planes": table, "pairs": b.pointer(pairs)},
                          reached=[arr.native for arrays in groups.values() for arr in arrays])], None


def _check_pairs(pairs: np.ndarray, num_blocks: int) -> None:
    bad = np.argwhere((pairs < 0) | (pairs >= num_blocks))
    if bad.size:
        i, j = (int(x) for x in bad[0])
        raise ArgumentError(f"pairs[{i}, {j}] = {int(pairs[i, j])}: not a block of the pool (0..{num_blocks - 1})")
    dst = pairs[:, 1]
    values, counts = np.unique(dst, return_counts=True)
    if (counts > 1).any():
        block = int(values[np.argmax(counts > 1)])
        i, j = (int(x) for x in np.nonzero(dst == block)[0][:2])
        raise ArgumentError(f"pairs[{i}] and pairs[{j}] both copy into block {block}: a dst may appear once per call")
    both = np.intersect1d(pairs[:, 0], dst)
    if both.size:
        block = int(both[0])
        i, j = int(np.nonzero(pairs[:, 0] == block)[0][0]), int(np.nonzero(dst == block)[0][0])
        raise ArgumentError(f"block {block} is the src of pairs[{i}] and the dst of pairs[{j}]: a block may not be "
                            "read and written in one call (split the copies into two calls)")


def _device_table(like: ArrayArg, table: np.ndarray):
    """The plane table where the kernel can read it: numpy on the CPU, else a CuPy array copied on
    the current stream, which for torch tensors is torch's current stream (the call runs inside
    kgen.runtime.placement.on_callers_stream). CuPy stages the copy in pinned memory and does not
    wait for it (no host sync); its pool frees the table in that stream's order."""
    if like.device == "cpu":
        return table
    import cupy

    return cupy.asarray(table)


COPY_BLOCKS = CopyBlocksFamily()
