"""Where a call's launches go: the device its arrays are on and the stream the caller is using.

One seam for every way a kernel is called (directly, through torch.ops.kgen, from the vLLM
plugin): with torch CUDA tensors the launches go on torch's current stream of their device (so
they are ordered with torch's work and captured by torch.cuda.graph), with CuPy arrays on
CuPy's current stream, always with the arrays' device current. Arrays on different devices, or
on a device other than the kernel module's, are refused before anything runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from kgen.errors import ArgumentError
from kgen.optional import module_of


def _device_of(value: Any) -> tuple[str, int] | None:
    """("torch" | "cupy", device index) of a CUDA array; None for anything else."""
    library = module_of(value)
    if library == "torch" and hasattr(value, "data_ptr"):
        device = value.device
        return ("torch", device.index or 0) if device.type == "cuda" else None
    if library == "cupy" and hasattr(value, "data"):
        return "cupy", int(value.device.id)
    return None


def device_index(value: Any) -> int | None:
    """The CUDA device index of a torch CUDA tensor or CuPy array; None for host arrays."""
    found = _device_of(value)
    return None if found is None else found[1]


def call_device(arguments: dict[str, Any]) -> tuple[int, bool] | None:
    """(device index, any torch tensor) of the call's CUDA arrays; None when it has none.
    ArgumentError naming two arguments on different devices."""
    first: tuple[str, int] | None = None
    torch_seen = False
    for name, value in arguments.items():
        for i, item in enumerate(value if isinstance(value, list | tuple) else (value,)):
            found = _device_of(item)
            if found is None:
                continue
            label = f"{name}[{i}]" if isinstance(value, list | tuple) else name
            torch_seen |= found[0] == "torch"
            if first is None:
                first = (label, found[1])
            elif found[1] != first[1]:
                raise ArgumentError(f"{label} is on cuda:{found[1]} but {first[0]} is on cuda:{first[1]}: every "
                                    "array of one call must be on the same GPU")
    return None if first is None else (first[1], torch_seen)


@contextlib.contextmanager
def on_callers_stream(arguments: dict[str, Any], module_device: int | None) -> Iterator[None]:
    """Run the body with the call's device current and, for torch tensors, torch's current stream
    of that device as CuPy's current stream. `module_device`: the device the kernel was loaded
    on (None: a CPU module, nothing to do)."""
    if module_device is None:
        yield
        return
    placed = call_device(arguments)
    if placed is None:
        yield
        return
    device, torch_seen = placed
    if device != module_device:
        raise ArgumentError(f"the call's arrays are on cuda:{device}, but this kernel was loaded on "
                            f"cuda:{module_device}: build or load it with cuda:{device} current")
    import cupy

    with contextlib.ExitStack() as stack:
        stack.enter_context(cupy.cuda.Device(device))
        if torch_seen:
            import torch

            stream = torch.cuda.current_stream(device)
            stack.enter_context(cupy.cuda.ExternalStream(stream.cuda_stream, device))
        yield
