"""Shared test setup: GPU-only tests (@pytest.mark.gpu) are skipped unless CuPy sees a device."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    from kgen.runtime.cuda import gpu_available

    if gpu_available():  # probed once per session
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
