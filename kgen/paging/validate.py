"""Argument checks shared by the manager's entry points: ids and tokens become int
arrays or a clear InvalidTokens, never a silent float-to-int cast."""

from __future__ import annotations

import operator

import numpy as np

from kgen.paging.errors import InvalidTokens

_INT32_MAX = np.iinfo(np.int32).max


def seq_id(x: object) -> int:
    """One sequence id: a Python or numpy integer (not a bool)."""
    if isinstance(x, bool | np.bool_):
        raise InvalidTokens(f"sequence ids must be integers, got {x!r}")
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidTokens(f"sequence ids must be integers, got {type(x).__name__} {x!r}") from None


def seq_ids(x: object) -> np.ndarray:
    """A 1-D int64 array of sequence ids."""
    a = np.asarray(x)
    if a.ndim != 1:
        raise InvalidTokens(f"seq_ids must be one-dimensional, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        if a.size:
            raise InvalidTokens(f"seq_ids must be integers, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def tokens(x: object, what: str = "tokens") -> np.ndarray:
    """A 1-D int32 array of token ids in [0, 2**31)."""
    a = np.asarray(x)
    if a.ndim != 1:
        raise InvalidTokens(f"{what} must be a one-dimensional sequence of ints, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        if a.size:
            raise InvalidTokens(f"{what} must be integer token ids, got dtype {a.dtype}")
        return np.zeros(0, dtype=np.int32)
    if a.size and (a.min() < 0 or a.max() > _INT32_MAX):
        raise InvalidTokens(f"{what} must lie in [0, 2**31), got range [{a.min()}, {a.max()}]")
    return a.astype(np.int32, copy=False)


def token_count(x: object, what: str, upto: int) -> int:
    """A count of tokens in [0, upto]: an integer (not a bool)."""
    if isinstance(x, bool | np.bool_):
        raise InvalidTokens(f"{what} must be an integer, got {x!r}")
    try:
        n = operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidTokens(f"{what} must be an integer, got {type(x).__name__} {x!r}") from None
    if not 0 <= n <= upto:
        raise InvalidTokens(f"{what} must lie in [0, {upto}] (the sequence's tokens), got {n}")
    return n
