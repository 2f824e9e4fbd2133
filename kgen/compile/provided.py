"""The headers a kernel source may include: CUDA's number formats and kgen's own.

Both compilers resolve them to the same files: NVRTC from the CUDA include directory and,
for kgen's headers, the program's header list; g++ from the same CUDA directory and a
directory kgen writes its headers into. Nothing else is on either include path that a
kernel may name (the source policy refuses every other `#include`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kgen.paths import templates_dir

# CUDA's own headers a kernel may include (found in cuda_include_dir()).
CUDA_HEADERS = ("cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h", "vector_types.h", "vector_functions.h",
                "math_constants.h")
# kgen's headers: include name -> file under templates/.
KGEN_HEADERS = {"kgen/platform.cuh": "common/platform.cuh"}
ALLOWED_INCLUDES = (*CUDA_HEADERS, *KGEN_HEADERS)


def kgen_headers() -> dict[str, str]:
    """{include name: text} of kgen's provided headers."""
    root = templates_dir()
    return {name: (root / rel).read_text() for name, rel in KGEN_HEADERS.items()}


def kgen_headers_digest() -> str:
    h = hashlib.sha256()
    for name, text in sorted(kgen_headers().items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def write_kgen_headers(include_dir: Path) -> Path:
    """Write kgen's headers under `include_dir` (for g++'s -I); returns it."""
    for name, text in kgen_headers().items():
        path = include_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return include_dir
