"""The hand-written kernel corpus (tests/verify/corpus/, described by its manifest.yaml) run
through the real `kgen verify SPEC --source FILE`, one subprocess per file (tests/verify/corpus_runner.py).

Correct originals must pass (exit 0); every kernel that cheats only while watched (cheat_*, ISSUE 21)
must be rejected (exit 1), or, where it keeps state across launches or reads the time, refused by the
source policy naming the rule and the line (exit 2; the manifest's `rule:`); every hostile kernel must be refused (exit 2) or rejected (exit 1) by a
verifier that returns on its own (no signal, no timeout) and creates nothing outside its scratch
directory: no /tmp/kgen_corpus_pwned_* marker, nothing in the working directory it was started in,
and no echo of a file the kernel tried to #include. The mutants (one planted bug each) are
tests/verify/test_corpus_mutants.py's.

The cheats are slow (each a whole verification run): a representative subset runs by default,
the entries marked `tier: full` in the manifest in the full tier (`pytest --tier full`).
"""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest
from corpus_runner import (  # tests/verify/corpus_runner.py
    CORPUS,
    EXIT,
    MANIFEST,
    check_entry,
    entries,
    spec_of,
)

MAX_EDIT_LINES = 20  # a mutant or hostile kernel is a small, reviewable edit of its original


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kgen_cache")


def test_manifest_lists_every_file():
    on_disk = {str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*.cu")}
    assert on_disk == set(MANIFEST)
    kinds = ("original", "mutant_", "hostile_", "cheat_")
    for entry, info in MANIFEST.items():
        assert info["expect"] in EXIT, entry
        assert Path(entry).name.startswith(kinds), f"{entry}: the corpus tests choose entries by these prefixes {kinds}"
        assert spec_of(entry).is_file(), entry
        assert (CORPUS / entry).with_name("original.cu").is_file(), entry


@pytest.mark.parametrize("entry", [e for e in MANIFEST if not e.endswith("/original.cu")])
def test_variant_is_a_small_edit_of_its_original(entry):
    original = (CORPUS / entry).with_name("original.cu").read_text().splitlines()
    variant = (CORPUS / entry).read_text().splitlines()
    changed = [line for line in difflib.unified_diff(original, variant, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert 0 < len(changed) <= MAX_EDIT_LINES, "\n".join(changed)


@pytest.mark.parametrize("entry", entries(("original", "hostile_", "cheat_")))
def test_verify_source(entry, cache_dir, tmp_path):
    check_entry(entry, cache_dir, tmp_path)
