"""Each family reads a call's tuning bucket back from the shapes of the inputs its bench() builds
for that bucket, so a TunedKernel picks the variant tuned for calls like it."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ROOT

from kgen.families.base import resolve_config
from kgen.families.registry import family_for
from kgen.spec.models import load_spec

SPECS = ["llama3_8b_decode.yaml", "cache_write_fp8_e4m3.yaml", "copy_blocks_fp16.yaml", "llama3_8b_prefill.yaml"]


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("bucket", [(1, 64), (4, 256), (3, 100)])
def test_bucket_of_reads_back_the_bench_bucket(name, bucket):
    spec = load_spec(ROOT / "specs" / name)
    family = family_for(spec)
    config = resolve_config(family, spec, None)
    bench = family.bench(spec, config, bucket, np.random.default_rng(0))
    got = family.bucket_of(spec, bench.args)
    B = spec.kv_cache.block_size
    whole = -(-bucket[1] // B) * B  # the bench holds whole blocks
    if name.startswith("copy_blocks"):  # a copy has no batch: every block of the bucket, as one context
        assert got == (1, bucket[0] * whole)
    else:  # the decode and prefill benches' block tables may carry one spare column
        assert got[0] == bucket[0] and whole <= got[1] <= whole + B


@pytest.mark.parametrize("name", SPECS)
def test_bucket_of_is_none_when_the_arguments_do_not_say(name):
    spec = load_spec(ROOT / "specs" / name)
    assert family_for(spec).bucket_of(spec, {}) is None
