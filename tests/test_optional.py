"""Optional dependencies and seeds: detected and drawn one way everywhere."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kgen.errors import KgenUserError
from kgen.optional import is_torch_tensor, module_of, require
from kgen.seeds import fresh_seed


def test_module_of_and_torch_detection():
    torch = pytest.importorskip("torch")
    assert module_of(np.zeros(2)) == "numpy" and module_of(torch.zeros(2)) == "torch"
    assert is_torch_tensor(torch.zeros(2)) and not is_torch_tensor(np.zeros(2))
    assert not is_torch_tensor(torch.float32)  # from torch, but not a tensor
    assert module_of(3) == "builtins"


def test_detection_imports_nothing():
    code = ("import sys, numpy as np; from kgen.optional import is_torch_tensor, module_of; "
            "assert not is_torch_tensor(np.zeros(1)) and module_of(np.zeros(1)) == 'numpy'; "
            "print(sorted(m for m in ('torch', 'cupy', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_require_names_what_needs_it_and_how_to_install():
    assert require("json", "a test", "nothing to install").dumps([1]) == "[1]"
    with pytest.raises(KgenUserError, match=r"the frobnicator needs kgen_no_such_module_x.*pip install frob"):
        require("kgen_no_such_module_x", "the frobnicator", "pip install frob")


def test_fresh_seeds_are_int64_and_differ():
    seeds = {fresh_seed() for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    np.random.default_rng(max(seeds))  # usable as a numpy seed
