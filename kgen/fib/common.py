"""What every FlashInfer-Bench op type kgen converts shares (docs/interop.md §6): dtype names, the
softmax scale of a Definition, spec names and checks, and the family's answers (its FIB kind, its rows).
The op types themselves: kgen/fib/convert.py (gqa_paged) and kgen/fib/mla.py (mla_paged)."""

from __future__ import annotations

import math
import re
from typing import Any

from kgen.errors import KgenUserError, SpecError
from kgen.families.registry import family_for, support_problems
from kgen.fib.schema import Definition, parse
from kgen.spec.models import spec_from_dict
from kgen.version import __version__

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


def definition_is_prefill(d: Definition) -> bool:
    return "qo_indptr" in d.inputs or "_prefill" in d.name


def io_problems(d: Definition, needed: list[str], what: str) -> list[str]:
    """The inputs and outputs of `d` that an op type's import misses or does not know: `needed` (the
    inputs it requires for `what`, e.g. "MLA prefill"), sm_scale and kv_last_page_len besides; the
    output `output` (and lse)."""
    known = set(needed) | {"sm_scale", "kv_last_page_len"}
    problems = [f"inputs.{n}: required for {what}" for n in needed if n not in d.inputs]
    problems += [f"inputs.{n}: kgen does not know this input (known: {', '.join(sorted(known))})"
                 for n in d.inputs if n not in known]
    if "output" not in d.outputs:
        problems.append("outputs.output: required")
    problems += [f"outputs.{n}: kgen does not know this output (known: output, lse)"
                 for n in d.outputs if n not in ("output", "lse")]
    return problems


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


def export_format_problems(spec, op: str, exported: str) -> list[str]:
    """What no exported `op` Definition carries (dequantization scales; lengths that are multiples of the
    block size): `exported` names the cache dtypes the op's export takes."""
    problems = []
    if spec.kv_cache.dtype not in FIB_DTYPES:
        problems.append(f"kv_cache.dtype {spec.kv_cache.dtype}: exported are {exported} (FlashInfer-Bench's "
                        f"{op} definitions carry no dequantization scales)")
    if not spec.tail_masking:
        problems.append("tail_masking: false promises lengths that are multiples of block_size, which "
                        "FlashInfer-Bench's workloads do not keep")
    return problems


def solution_name(spec) -> str:
    return f"kgen_{spec.name}"


def paging_inputs(spec) -> dict[str, Any]:
    """The inputs every paged Definition ends with, in FlashInfer-Bench's order: prefill's qo_indptr,
    kv_indptr, kv_indices, kv_last_page_len (pages of more than one token), sm_scale."""
    out: dict[str, Any] = {}
    if is_prefill(spec):
        out["qo_indptr"] = {"shape": ["len_indptr"], "dtype": "int32",
                            "description": "request i owns query rows qo_indptr[i] .. qo_indptr[i+1]-1"}
    out["kv_indptr"] = {"shape": ["len_indptr"], "dtype": "int32",
                        "description": "request i owns pages kv_indices[kv_indptr[i]:kv_indptr[i+1]]"}
    out["kv_indices"] = {"shape": ["num_kv_indices"], "dtype": "int32", "description": "page ids"}
    if spec.kv_cache.block_size > 1:
        out["kv_last_page_len"] = {"shape": ["batch_size"], "dtype": "int32",
                                   "description": "tokens in each request's last page (1..page_size)"}
    out["sm_scale"] = {"shape": None, "dtype": "float32",
                       "description": f"softmax scale; kgen's kernel is built for {spec.softmax_scale_value!r}"}
    return out


def paged_definition(spec, name: str, op: str, *, const_axes: dict[str, int], description: str, inputs: dict[str, Any],
                     out_dim: str, reference: str) -> dict[str, Any]:
    """The paged Definition `name` (a dict), validated against kgen.fib.schema.Definition: `const_axes`
    and the paged var axes, the paging constraints, `inputs`, the outputs output [rows, num_qo_heads,
    `out_dim`] and lse (base 2), the reference source."""
    prefill = is_prefill(spec)
    rows = "total_q" if prefill else "batch_size"
    axes: dict[str, Any] = {name: {"type": "const", "value": value} for name, value in const_axes.items()}
    for var in (["total_q"] if prefill else []) + ["batch_size", "num_pages", "len_indptr", "num_kv_indices"]:
        axes[var] = {"type": "var"}
    constraints = (["total_q == qo_indptr[-1]"] if prefill else []) + [
        "len_indptr == batch_size + 1", "num_kv_indices == kv_indptr[-1]", f"sm_scale == {spec.softmax_scale_value!r}"]
    stage = "prefill" if prefill else "decode"
    doc = {
        "name": name, "op_type": op,
        "description": f"{description} Exported by kgen {__version__} from spec '{spec.name}' (kgen fib export).",
        "tags": ["source:kgen", f"kgen:spec:{spec.name}", f"stage:{stage}"],
        "axes": axes, "constraints": constraints, "inputs": inputs,
        "outputs": {"output": {"shape": [rows, "num_qo_heads", out_dim], "dtype": FIB_DTYPES[spec.dtype.resolved_out],
                               "description": "attention output"},
                    "lse": {"shape": [rows, "num_qo_heads"], "dtype": "float32",
                            "description": "base-2 log-sum-exp of the scaled logits (-inf for a row with no key)"}},
        "reference": reference,
    }
    parse(Definition, doc, f"{name} (exported)")  # kgen writes only what its schema accepts
    return doc


def what_it_computes(spec) -> str:
    """decode, prefill or causal prefill: the stage a Definition's description names."""
    prefill = is_prefill(spec)
    return "causal prefill" if prefill and spec.attention.causal else ("prefill" if prefill else "decode")


# The start of every exported reference's `run`, after its tensors are read as float64: the paging as numpy.
_REFERENCE_PAGING = """\
    indptr, indices = _ints(kv_indptr), _ints(kv_indices)
    batch = len(indptr) - 1
    last = {last}
    q_starts = {q_starts}
    scale = float(sm_scale)"""


def reference_fields(spec) -> dict[str, Any]:
    """The format fields both references take: the page size, causality, and `paging`, the lines of
    `run` that read the page table, each request's last-page length and query-row starts, and sm_scale."""
    prefill = is_prefill(spec)
    last = ("_ints(kv_last_page_len)" if spec.kv_cache.block_size > 1
            else "np.minimum(indptr[1:] - indptr[:-1], 1) * PAGE_SIZE  # one token per page")
    q_starts = "_ints(qo_indptr)" if prefill else "np.arange(batch + 1)  # one query row per request"
    return {"page": spec.kv_cache.block_size, "causal": prefill and spec.attention.causal,
            "paging": _REFERENCE_PAGING.format(last=last, q_starts=q_starts)}


# The exported references' shared helpers (plain text: every reference is one self-contained file).
REFERENCE_HELPERS = '''\
def _f64(x):
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        return (x.double() if x.is_floating_point() else x).numpy().astype(np.float64)
    return np.asarray(x).astype(np.float64)


def _ints(x):
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy().astype(np.int64)
    return np.asarray(x).astype(np.int64)


def _weights(logits, causal):
    """(softmax weights, base-2 lse [q_len, heads]) of one request's logits [heads, q_len, kv_len]; causal:
    row i of the chunk sits at kv_len - q_len + i and sees the keys up to there; a row with no key:
    weights 0, lse -inf."""
    q_len, kv_len = logits.shape[1], logits.shape[2]
    if causal:
        visible = np.arange(kv_len)[None, :] <= (kv_len - q_len + np.arange(q_len))[:, None]
        logits = np.where(visible[None], logits, -np.inf)
    m = logits.max(axis=-1, keepdims=True)
    seen = np.isfinite(m)
    p = np.where(seen, np.exp(logits - np.where(seen, m, 0.0)), 0.0)
    total = p.sum(axis=-1, keepdims=True)
    ok = total[..., 0] > 0
    lse = np.where(ok, (m[..., 0] + np.log(np.where(ok, total[..., 0], 1.0))) / math.log(2.0), -np.inf).T
    return p / np.where(total > 0, total, 1.0), lse
'''
