"""Fixtures for the paging tests."""

from __future__ import annotations

import pytest
from paging_helpers import fingerprint


@pytest.fixture
def fp():
    return fingerprint
