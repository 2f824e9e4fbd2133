"""Every registered family implements the whole Family interface consistently: what the next
family must provide, checked on a bundled spec of every family a bundled spec resolves to (the
mla layout's families included)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

import kgen
from kgen.errors import KgenUserError
from kgen.families.argtable import ROLES
from kgen.families.attention.common import Rows
from kgen.families.base import Family, PerfModel, resolve_config
from kgen.families.pool import pool_of
from kgen.families.registry import FAMILIES, family_for, registered
from kgen.fib.convert import OP_TYPE
from kgen.fib.mla import OP_TYPE as MLA_OP_TYPE
from kgen.formats.cache import CacheFormat
from kgen.render import render
from kgen.tune.search import expand_space

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted((ROOT / "specs").glob("*.yaml"))


def _first_spec_of_each_family() -> dict[str, Path]:
    """{family name: the first bundled spec (by file name) that resolves to it}."""
    out: dict[str, Path] = {}
    for path in SPECS:
        family = family_for(kgen.load_spec(path))
        out.setdefault(type(family).__name__, path)
    return out


BUNDLED = _first_spec_of_each_family()
METHODS = [name for name in vars(Family) if not name.startswith("_") and callable(getattr(Family, name))]


def test_every_family_is_bundled_and_registered():
    assert set(BUNDLED) <= {type(f).__name__ for f in registered()}
    # every kind over the paged pool and both attention kinds over the latent pool have a bundled spec
    # (the mla cache write has none yet)
    assert {type(by_pool["paged"]).__name__ for by_pool in FAMILIES.values()} <= set(BUNDLED)
    assert {type(FAMILIES[k]["latent"]).__name__ for k in ("paged_decode", "paged_prefill")} <= set(BUNDLED)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_the_registry_picks_by_kind_then_pool(path):
    """One dict keyed by kind; within a kind, the spec's pool format (kgen/families/pool.py) picks."""
    spec = kgen.load_spec(path)
    assert family_for(spec) is FAMILIES[spec.kind][pool_of(spec).name]
    assert {"arguments", "kernels", "cases", "run_case", "bench", "abi_config", "default_space"} <= set(METHODS)


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_family_is_consistent(name):
    spec = kgen.load_spec(BUNDLED[name])
    family = family_for(spec)
    kind = family.kind
    assert spec.kind == kind and (ROOT / "templates" / family.template).is_file()
    for name in METHODS:
        assert callable(getattr(family, name, None)), f"{kind} lacks {name}"
    space = family.default_space(spec)
    assert set(space) <= set(family.params)
    configs = [resolve_config(family, spec, dict(zip(space, values, strict=True)))
               for values in itertools.product(*space.values())]
    configs.append(resolve_config(family, spec, family.abi_config(spec)))
    for config in configs:
        assert family.check_config(spec, config) == [], config
        table = family.arguments(spec, config)
        names = [a.name for a in table]
        assert len(set(names)) == len(names) and all(a.role in ROLES for a in table)
        kernels = family.kernels(spec, config)
        assert kernels[0].params == tuple(table)  # the main kernel takes the whole table, in order
        if "threads" in config:  # the decode tensor-core body runs as many of them as its tiles fit in smem
            tensor_cores = kind == "paged_decode" and "TENSOR_CORES = true" in render(spec, config).source
            assert kernels[0].block == config["threads"] or (tensor_cores and kernels[0].block < config["threads"])
        assert kernels[0].block % 32 == 0 and kernels[0].block <= 1024  # whole warps (prefill: 32 * warps)
        rows = {a.name: a for a in table}
        for k in kernels[1:]:  # the others take rows of it (constness may differ: a reader of scratch)
            assert all(rows[a.name].ctype.removeprefix("const ") == a.ctype.removeprefix("const ") for a in k.params)
        assert family.kernel_names(spec, config) == render(spec, config).kernel_names == [k.name for k in kernels]


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_nothing_to_tune_suggests_the_family_space(name):
    spec = kgen.load_spec(BUNDLED[name]).with_overrides(tuning=None)
    with pytest.raises(KgenUserError, match="nothing to tune") as e:
        expand_space(spec)
    assert str(family_for(spec).default_space(spec)) in str(e.value)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_capabilities_answer_what_perf_and_fib_ask(path):
    """What code outside kgen/families/ asks instead of comparing families (kgen/families/base.py):
    the query-row axis, the static model and the FlashInfer-Bench kind agree with each other and with
    what the family builds, for the family of every bundled spec."""
    spec = kgen.load_spec(path)
    family = family_for(spec)
    assert family.rows is None or isinstance(family.rows, Rows)
    assert isinstance(family.perf_model, PerfModel)
    if family.perf_model in (PerfModel.STREAMING, PerfModel.TILES, PerfModel.LATENT):
        assert family.rows is not None  # the models read attention kernels
    if family.perf_model is PerfModel.STREAMING:  # the contract kgen/perf/report.py's tile_hint reads
        config = resolve_config(family, spec, None)
        ctx = family.template_context(spec, config, family.kernels(spec, config))
        assert {"geo", "tensor_cores"} <= set(ctx) and ctx["geo"].tile_tokens > 0
    if family.fib_kind is not None:  # gqa_paged_* or (latent rows) mla_paged_*, matching the rows it packs
        op = MLA_OP_TYPE if CacheFormat.of(spec).mla else OP_TYPE
        assert family.fib_kind == f"{op}_{'prefill' if family.rows.packed else 'decode'}"
