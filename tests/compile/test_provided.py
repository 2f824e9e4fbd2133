"""kgen's provided headers (kgen/compile/provided.py): every body reaches a source as one, and
`kgen show`'s editable copy pastes in the bodies a hand-written source may hold as kernel code."""

from __future__ import annotations

from pathlib import Path

from kgen.compile.provided import PROVIDED_HEADERS, editable_source, kgen_headers
from kgen.render import render
from kgen.spec.models import load_spec

ROOT = Path(__file__).resolve().parents[2]


def test_every_provided_header_is_a_file_under_templates():
    assert set(kgen_headers()) == set(PROVIDED_HEADERS)
    assert all((ROOT / "templates" / rel).is_file() for rel in PROVIDED_HEADERS.values())


def test_the_editable_copy_pastes_a_body_without_compiler_branches_only():
    decode = render(load_spec(ROOT / "specs" / "llama3_8b_decode.yaml"), {"mma_min_group": 0}).source
    shown = editable_source(decode)
    assert '#include "kgen/bodies/paged_decode.cuh"' in decode and "kgen/bodies/" not in shown
    assert shown == decode.replace('#include "kgen/bodies/paged_decode.cuh"\n',
                                   kgen_headers()["kgen/bodies/paged_decode.cuh"])
    prefill = render(load_spec(ROOT / "specs" / "llama3_8b_prefill.yaml"), None, "sm_80").source
    assert '#include "kgen/bodies/paged_prefill.cuh"' in prefill  # the sm_75 fallback: a compiler branch
    assert editable_source(prefill) == prefill
