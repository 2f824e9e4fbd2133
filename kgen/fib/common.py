"""What every FlashInfer-Bench op type kgen converts shares (docs/interop.md §6): dtype names, the
softmax scale of a Definition, spec names and checks, and the family's answers (its FIB kind, its rows).
The op types themselves: kgen/fib/convert.py (gqa_paged) and kgen/fib/mla.py (mla_paged)."""

from __future__ import annotations

import math
import re
from typing import Any

from kgen.errors import KgenUserError, SpecError
from kgen.families.registry import family_for, support_problems
from kgen.fib.schema import Definition
from kgen.spec.models import spec_from_dict

DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
FIB_DTYPES = {v: k for k, v in DTYPES.items()}
_SCALE = re.compile(r"^\s*sm_scale\s*==\s*([0-9.eE+-]+)\s*$")


def constraint_scale(d: Definition) -> float | None:
    """The number of a `sm_scale == <number>` constraint, or None."""
    for c in d.constraints or []:
        m = _SCALE.match(c)
        if m:
            try:
                return float(m.group(1))
            except ValueError:
                continue
    return None


def chosen_scale(d: Definition, given: float | None, origin: str = "") -> float | None:
    """The softmax scale to build for: `given` (the caller's, e.g. `kgen fib import --sm-scale`), else the
    Definition's constraint, else None. KgenUserError when both are there and differ."""
    fixed = constraint_scale(d)
    if given is not None and fixed is not None and not math.isclose(given, fixed, rel_tol=1e-6):
        raise KgenUserError(f"{origin + ': ' if origin else ''}definition '{d.name}': sm_scale {given} given, but "
                            f"its constraints fix sm_scale == {fixed}")
    return given if given is not None else fixed


def spec_name(definition_name: str) -> str:
    name = re.sub(r"\W", "_", definition_name)
    return name if re.match(r"^[A-Za-z_]", name) else f"fib_{name}"


def checked_spec(data: dict[str, Any], d: Definition, origin: str) -> dict[str, Any]:
    """`data` when it is a spec kgen validates *and* builds; else KgenUserError with every reason,
    each naming the spec field (what the format refuses, then what no family builds)."""
    try:
        spec = spec_from_dict(data, filename=origin)
    except SpecError as e:
        raise KgenUserError(f"{origin}: definition '{d.name}' maps to a spec kgen refuses:\n"
                            + "\n".join(f"  {p}" for p in e.errors)) from None
    problems = support_problems(spec)
    if problems:
        raise KgenUserError(f"{origin}: definition '{d.name}' maps to a spec kgen does not build:\n"
                            + "\n".join(f"  {p.removeprefix(spec.name + ': ')}" for p in problems))
    return data


def refuse(d: Definition, origin: str, problems: list[str]) -> None:
    if problems:
        raise KgenUserError(f"{origin}: definition '{d.name}' cannot be imported:\n"
                            + "\n".join(f"  {p}" for p in problems))


def fib_kind(spec) -> str | None:
    """The FlashInfer-Bench definition kind the spec's kernel is exported as (its family's answer), or None."""
    return family_for(spec).fib_kind


def op_type(spec) -> str | None:
    """The Definition's op_type: the kind without its stage (gqa_paged_decode -> gqa_paged)."""
    kind = fib_kind(spec)
    return kind.rsplit("_", 1)[0] if kind else None


def is_prefill(spec) -> bool:
    """Query rows packed by sequence (FlashInfer-Bench's qo_indptr and total_q): the family's Rows say."""
    rows = family_for(spec).rows
    return rows is not None and rows.packed


def dtype_suffix(spec, name: str) -> str:
    """FlashInfer-Bench's datasets are bf16: other dtypes are appended to the definition's name."""
    dtypes = {spec.dtype.q, spec.dtype.resolved_out, spec.kv_cache.dtype}
    return name if dtypes == {"bf16"} else f"{name}_{'_'.join(sorted(dtypes))}"


def solution_name(spec) -> str:
    return f"kgen_{spec.name}"
