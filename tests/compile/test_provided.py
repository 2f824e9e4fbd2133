"""kgen's provided headers (kgen/compile/provided.py): every body reaches a source as one, and
`kgen show`'s editable copy pastes in the bodies a hand-written source may hold as kernel code."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kgen.compile.provided import (
    PROVIDED_HEADERS,
    editable_source,
    kgen_headers,
    kgen_headers_digest,
)
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


def _templates_copy(tmp_path: Path, mtime_ns: int | None = None) -> Path:
    """kgen's provided headers copied under `tmp_path` (their mtimes set to `mtime_ns` when given)."""
    for rel in PROVIDED_HEADERS.values():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((ROOT / "templates" / rel).read_text())
        if mtime_ns is not None:
            os.utime(tmp_path / rel, ns=(mtime_ns, mtime_ns))
    return tmp_path


def _same_size_edit(path: Path) -> None:
    text = path.read_text()
    path.write_text(text.replace("#pragma once", "#pragma ONCE", 1) if "#pragma once" in text else
                    text.replace("#pragma ONCE", "#pragma once", 1))


def test_the_headers_digest_follows_an_edit_made_at_once(tmp_path):
    """kgen_headers_digest is in every compile cache key: a header edited just after it was read (to
    the same size, within the file system's timestamp granularity) still gives new texts and a new
    digest. Content, not path, counts."""
    root = _templates_copy(tmp_path)
    seen = {kgen_headers_digest(root)}
    assert seen == {kgen_headers_digest()}
    for name, rel in list(PROVIDED_HEADERS.items())[:6]:
        before = kgen_headers(root)[name]
        _same_size_edit(root / rel)
        assert kgen_headers(root)[name] == (root / rel).read_text() != before
        seen.add(kgen_headers_digest(root))
    assert len(seen) == 7


def test_the_memoised_headers_digest_changes_with_a_headers_size_or_mtime(tmp_path):
    """Headers older than the racy window are memoised on their stamps: a change of size or of mtime
    alone is a new digest (a memo keyed on the folder alone would return the first)."""
    hour_ago = time.time_ns() - 3600 * 10**9
    root = _templates_copy(tmp_path, hour_ago)
    first = kgen_headers_digest(root)
    assert kgen_headers_digest(root) == first == kgen_headers_digest()
    rel = PROVIDED_HEADERS["kgen/softmax.cuh"]
    (root / rel).write_text((root / rel).read_text() + "// appended\n")
    os.utime(root / rel, ns=(hour_ago, hour_ago))
    grown = kgen_headers_digest(root)
    assert grown != first and kgen_headers(root)["kgen/softmax.cuh"].endswith("// appended\n")
    _same_size_edit(root / rel)
    os.utime(root / rel, ns=(hour_ago + 10**9, hour_ago + 10**9))
    assert kgen_headers_digest(root) not in (first, grown)
    assert "#pragma ONCE" in kgen_headers(root)["kgen/softmax.cuh"]
