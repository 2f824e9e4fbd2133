"""What the measuring scripts (gpu_decode.py, gpu_prefill.py) share: a CUDA torch, or the exit status
that says nothing was measured."""

from __future__ import annotations

import sys

from kgen.runtime.cuda import gpu_available

NO_GPU_EXIT = 2


def cuda_torch(script: str, static: str, needs: str):
    """torch with a CUDA device, or None after saying on stderr why nothing was measured (no GPU for
    CuPy, or a torch without CUDA); the caller then exits NO_GPU_EXIT."""
    if not gpu_available():
        print(f"{script}: no CUDA GPU visible (CuPy sees none); these figures need one, so nothing was "
              f"measured. {static} gives the static estimates without a GPU.", file=sys.stderr)
        return None
    import torch

    if not torch.cuda.is_available():
        print(f"{script}: CuPy sees a GPU but torch does not (a CPU-only torch?); {needs} need torch with "
              "CUDA. Nothing was measured.", file=sys.stderr)
        return None
    return torch
