"""The hand-written corpus's mutants (tests/verify/corpus/*/mutant_*.cu: one planted bug each, named
in the manifest) run through the real `kgen verify SPEC --source FILE`: each must be rejected
(exit 1), create nothing and show no secret (tests/verify/corpus_runner.py). The whole-matrix
mutants marked `tier: full` in the manifest are the full tier's. Apart from test_corpus.py so that
the two halves of the corpus run on both workers."""

from __future__ import annotations

from pathlib import Path

import pytest
from corpus_runner import check_entry, entries  # tests/verify/corpus_runner.py


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kgen_cache")


@pytest.mark.parametrize("entry", entries(("mutant_",)))
def test_verify_source(entry, cache_dir, tmp_path):
    check_entry(entry, cache_dir, tmp_path)
