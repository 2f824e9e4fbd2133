"""The headers a kernel source may include: CUDA's number formats and kgen's own.

Both compilers resolve them to the same files: NVRTC from the CUDA include directory and,
for kgen's headers, the program's header list; g++ from the same CUDA directory and a
directory kgen writes its headers into. Nothing else is on either include path that a
kernel may name (the source policy refuses every other `#include`).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import time
from functools import lru_cache
from pathlib import Path

from kgen.paths import templates_dir

# CUDA's own headers a kernel may include (found in cuda_include_dir()).
CUDA_HEADERS = ("cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h", "vector_types.h", "vector_functions.h",
                "math_constants.h")
# kgen's headers: include name -> file under templates/.
# (mma.cuh and the prefill bodies hold the GPU/CPU spellings of mma.sync/ldmatrix and the sm_75
# fallback: provided, so a prefill source from `kgen show` passes the source policy; softmax.cuh is
# the online softmax and split-KV merge both attention bodies share: provided, so neither family's
# source inlines the other's body.) Kernel bodies: `kgen/bodies/` are kgen's internal bodies (templates/
# common/, one `const Params&` argument; they change with kgen); `kgen/abi1/` holds ABI 1's positional
# body calls (templates/abi1/, stable: docs/abi.md section 6), and ABI 1's own names of the prefill
# bodies, `kgen/paged_prefill.cuh` and `kgen/paged_prefill_wgmma.cuh`, are those same files.
ABI1_HEADERS = {"kgen/abi1/paged_decode.cuh": "abi1/paged_decode.cuh",
                "kgen/abi1/paged_decode_mma.cuh": "abi1/paged_decode_mma.cuh",
                "kgen/abi1/paged_prefill.cuh": "abi1/paged_prefill.cuh",
                "kgen/abi1/paged_prefill_wgmma.cuh": "abi1/paged_prefill_wgmma.cuh",
                "kgen/paged_prefill.cuh": "abi1/paged_prefill.cuh",
                "kgen/paged_prefill_wgmma.cuh": "abi1/paged_prefill_wgmma.cuh"}
PROVIDED_HEADERS = {"kgen/platform.cuh": "common/platform.cuh", "kgen/async_copy.cuh": "common/async_copy.cuh",
                    "kgen/convert.cuh": "common/convert.cuh", "kgen/softmax.cuh": "common/softmax.cuh",
                    "kgen/mma.cuh": "common/mma.cuh", "kgen/hopper.cuh": "common/hopper.cuh",
                    "kgen/bodies/paged_decode.cuh": "common/paged_decode.cuh",
                    "kgen/bodies/paged_decode_mma.cuh": "common/paged_decode_mma.cuh",
                    "kgen/bodies/paged_prefill.cuh": "common/paged_prefill.cuh",
                    "kgen/bodies/paged_prefill_wgmma.cuh": "common/paged_prefill_wgmma.cuh",
                    "kgen/bodies/paged_mla.cuh": "common/paged_mla.cuh",
                    "kgen/bodies/paged_mla_wgmma.cuh": "common/paged_mla_wgmma.cuh",
                    "kgen/ds_mla_row.cuh": "common/ds_mla_row.cuh",
                    "kgen/bodies/cache_write.cuh": "common/cache_write.cuh",
                    "kgen/bodies/cache_write_mla.cuh": "common/cache_write_mla.cuh",
                    "kgen/bodies/copy_blocks.cuh": "common/copy_blocks.cuh",
                    "kgen/attention/traits.cuh": "common/attention/traits.cuh",
                    "kgen/attention/visibility.cuh": "common/attention/visibility.cuh",
                    "kgen/attention/logits.cuh": "common/attention/logits.cuh",
                    "kgen/attention/softmax_tile.cuh": "common/attention/softmax_tile.cuh",
                    "kgen/attention/stage_ring.cuh": "common/attention/stage_ring.cuh",
                    "kgen/attention/kv_format.cuh": "common/attention/kv_format.cuh",
                    "kgen/attention/kv_pool.cuh": "common/attention/kv_pool.cuh",
                    "kgen/attention/simt_tile.cuh": "common/attention/simt_tile.cuh",
                    "kgen/attention/epilogue.cuh": "common/attention/epilogue.cuh",
                    "kgen/attention/wgmma_tile.cuh": "common/attention/wgmma_tile.cuh",
                    "kgen/attention/latent_rows.cuh": "common/attention/latent_rows.cuh",
                    "kgen/attention/mma_tile.cuh": "common/attention/mma_tile.cuh",
                    **ABI1_HEADERS}
ALLOWED_INCLUDES = (*CUDA_HEADERS, *PROVIDED_HEADERS)

# Names kgen reserves in kernel builds: C macros of its headers and compile commands, never read
# from the environment (`kgen env` lists them apart from the environment variables). A kernel
# source may use the first two (ABI 1 sources from `kgen show` do); it may not define or test any.
RESERVED_MACROS = {
    "KGEN_DYNAMIC_SMEM": "declares the block's dynamic shared memory (kgen/platform.cuh)",
    "KGEN_NEG_INF": "-inf as a float constant (kgen/platform.cuh)",
    "KGEN_SIMT": "defined when the CPU backend's SIMT runtime compiles the source",
    "KGEN_SIMT_H": "include guard of the SIMT runtime",
    "KGEN_SIMT_ASAN": "the CPU build is AddressSanitizer-instrumented (sanitize mode)",
    "KGEN_SIMT_UCONTEXT": "the SIMT runtime switches fibers with swapcontext (portable mode)",
    "KGEN_SIMT_ASM_SWITCH": "the SIMT runtime switches fibers with its own x86-64 code",
    "KGEN_SIMT_RACECHECK": "the CPU build carries shared-memory race detection",
    "KGEN_SIMT_RUNTIME_TU": "the translation unit that defines the race detector's callbacks",
    "KGEN_SIMT_ASYNC_WRITE": "tells the race detector where a cp.async copy writes (SIMT runtime)",
    "KGEN_SIMT_NOTSAN": "marks SIMT runtime code the race detector must not instrument",
    "KGEN_TSAN_CB": "declares one race-detector callback (SIMT runtime)",
    "KGEN_TSAN_ACCESS": "defines the race detector's plain-access callbacks (SIMT runtime)",
    "KGEN_TSAN_ATOMICS": "defines the race detector's atomic callbacks (SIMT runtime)",
    "KGEN_TSAN_ATOMIC_RW": "defines atomic load/store callbacks (SIMT runtime)",
    "KGEN_TSAN_FETCH": "defines atomic read-modify-write callbacks (SIMT runtime)",
    "KGEN_ATOMIC_FETCH": "defines the SIMT runtime's atomic fetch-and-op functions",
    "KGEN_ATOMIC_CAS": "defines the SIMT runtime's compare-and-swap functions",
    "KGEN_MINMAX": "defines the SIMT runtime's atomic min/max functions",
    "KGEN_PREFILL_HAS_MMA": "the prefill body uses mma.sync (sm_80 and later, and the CPU backend)",
    "KGEN_ABI1_DECODE_PARAMETERS": "ABI 1's positional decode parameters, shared by its wrappers (kgen/abi1/)",
    "KGEN_ABI1_DECODE_FIELDS": "the Params fields ABI 1's decode wrappers fill from them (kgen/abi1/)",
    "KGEN_ABI1_PREFILL_PARAMETERS": "ABI 1's positional prefill parameters, shared by its wrappers (kgen/abi1/)",
    "KGEN_ABI1_PREFILL_FIELDS": "the Params fields ABI 1's prefill wrappers fill from them (kgen/abi1/)",
}


# A header written this recently may be written again within its file system's timestamp granularity
# (up to a second or two), unseen by its stamps: it is read afresh until it is older (git's "racily clean").
_RACY_NS = 2_000_000_000
_fresh = itertools.count()


@lru_cache(maxsize=4)
def _header_paths(root: Path) -> tuple[str, ...]:
    return tuple(str(root / rel) for rel in PROVIDED_HEADERS.values())


def _stamps(root: Path) -> tuple[tuple[int, ...], ...]:
    """Each provided header's (mtime, ctime, size, inode), what an edit of the file changes; plus a
    token never seen before when one was modified within _RACY_NS (so the memo below is not used)."""
    stats = [os.stat(path) for path in _header_paths(root)]
    stamps = tuple((s.st_mtime_ns, s.st_ctime_ns, s.st_size, s.st_ino) for s in stats)
    if time.time_ns() - max(s.st_mtime_ns for s in stats) < _RACY_NS:
        return (*stamps, (next(_fresh),))
    return stamps


# Memoised on the files' stamps: a warm build asks for the headers' digest once per arch, and reading
# and hashing every provided header each time was about a third of it (docs/pipeline.md). An edited
# header has new stamps, so it is read again and the digest (part of every compile cache key) changes.
@lru_cache(maxsize=4)
def _read_headers(root: Path, _stamps: tuple[tuple[int, ...], ...]) -> tuple[tuple[str, str], ...]:
    return tuple((name, (root / rel).read_text()) for name, rel in PROVIDED_HEADERS.items())


@lru_cache(maxsize=4)
def _digest(root: Path, stamps: tuple[tuple[int, ...], ...]) -> str:
    h = hashlib.sha256()
    for name, text in sorted(_read_headers(root, stamps)):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def kgen_headers(root: Path | None = None) -> dict[str, str]:
    """{include name: text} of kgen's provided headers (a fresh dict: the caller may change it), read
    from `root` (a templates folder; default kgen's)."""
    root = root or templates_dir()
    return dict(_read_headers(root, _stamps(root)))


def kgen_headers_digest(root: Path | None = None) -> str:
    """sha256 over kgen's provided headers (names and texts) in `root` (default kgen's templates):
    part of every compile cache key."""
    root = root or templates_dir()
    return _digest(root, _stamps(root))


def write_kgen_headers(include_dir: Path) -> Path:
    """Write kgen's headers under `include_dir` (for g++'s -I); returns it."""
    for name, text in kgen_headers().items():
        path = include_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return include_dir


_CONDITIONAL = re.compile(r"^\s*#\s*if", re.M)


def editable_source(source: str) -> str:
    """`source` with each kernel body it includes (`kgen/bodies/`) that holds no preprocessor
    conditional pasted in where it is included: what `kgen show` prints, kernel code a hand-written
    source may carry and edit (the source policy refuses a compiler branch in a source, so a body
    with one, prefill's, stays included). It compiles as the source does; the copy is the editor's,
    so kgen's internal bodies may change without breaking it."""
    headers = kgen_headers()
    for name in PROVIDED_HEADERS:
        include = f'#include "{name}"\n'
        if name.startswith("kgen/bodies/") and include in source and not _CONDITIONAL.search(headers[name]):
            source = source.replace(include, headers[name])
    return source

