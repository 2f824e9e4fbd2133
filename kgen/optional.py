"""Detection of optional array libraries and dependencies, without importing them.

kgen accepts numpy arrays, torch tensors and CuPy arrays but must not import torch or
CuPy just to ask what an object is (importing torch costs seconds, and a user of the
CPU backend may not have it): an object's library is read from its type's module.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from kgen.errors import KgenUserError


def module_of(obj: Any) -> str:
    """The top-level package that defines `obj`'s type: "numpy", "torch", "cupy", "builtins", ..."""
    return type(obj).__module__.split(".")[0]


def is_torch_tensor(obj: Any) -> bool:
    return module_of(obj) == "torch" and hasattr(obj, "data_ptr")


def require(name: str, needed_for: str, install: str) -> ModuleType:
    """Import the optional package `name`, or KgenUserError saying what needs it and how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise KgenUserError(f"{needed_for} needs {name}, which is not installed: {install}") from None
