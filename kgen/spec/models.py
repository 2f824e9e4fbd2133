"""The kernel spec (the format: docs/architecture.md, `kgen schema`): pydantic models, the loader,
and user-facing errors.

Every field is checked by a before-validator (kgen/spec/checks.py) that words its own message, so a
bad value yields exactly one line `FILE:LINE: field.path: message (got X;
allowed: …)` and never pydantic's phrasing. Rules that span fields (GQA
divisibility, dtype vs arch, scale vs dtype, fields a kind does not read, tuning
cross-references) live in one function that runs on raw data after field
validation, skipping fields that already failed, so a file's errors are all
reported at once.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kgen.errors import SpecError
from kgen.formats.dtypes import MIN_SM, QUANTIZED
from kgen.spec.checks import (
    _EXPR_ALLOWED,
    _NAME_RE,
    _SCALAR_ALLOWED,
    INT32_MAX,
    _bool,
    _c_name,
    _Check,
    _check_constraint,
    _check_scalar,
    _fail,
    _int,
    _kind,
    _list,
    _mapping,
    _one_of,
    _positive,
    _show,
    _suggest,
    c_name_problem,
    constraint_names,
)
from kgen.spec.yaml_source import Loc, YamlDoc, YamlFileError, read_yaml

Kind = Literal["paged_decode", "paged_prefill", "cache_write", "copy_blocks"]
Layout = Literal["separate", "fused", "vllm", "mla"]
Order = Literal["NHD", "HND"]
QDType = Literal["fp16", "bf16", "fp32"]
KVDType = Literal["fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8", "nvfp4", "fp8_ds_mla"]
Scale = Literal["none", "per_tensor", "per_head", "per_token_head"]
Arch = Literal["sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100", "sm_120"]

KINDS, LAYOUTS, ORDERS = get_args(Kind), get_args(Layout), get_args(Order)
Q_DTYPES, KV_DTYPES, SCALES, ARCHS = get_args(QDType), get_args(KVDType), get_args(Scale), get_args(Arch)
QUANTIZED_KV_DTYPES = tuple(d for d in KV_DTYPES if d in QUANTIZED)
# Formats that carry their own scales, so kv_cache.scale stays none: which scales they carry.
SELF_SCALED_KV_DTYPES = {"nvfp4": "e4m3 per 16 elements and a tensor scale",
                         "fp8_ds_mla": "an fp32 scale per 128 latent values in each 656-byte row"}
# fp8_ds_mla (DeepSeek-V3.2's FP8 MLA cache, kgen/formats/ds_mla.py): the one shape it stores.
DS_MLA_DIMS = {"head_dim": 576, "v_head_dim": 512}
# Layouts a V head dim of its own can live in (one K and one V pool, or MLA's latent rows).
V_HEAD_DIM_LAYOUTS = ("separate", "mla")
NVFP4_LAYOUTS = ("separate", "mla")
DEFAULT_TARGETS: list[str] = ["sm_80", "sm_90"]
# MIN_SM: oldest arch with native support of each dtype (kgen/formats/dtypes.py's table)
MAX_HEADS = 4096
# Spec-derived values a tuning constraint may name besides the tuning parameters.
CONSTRAINT_SPEC_NAMES = ("group_size", "head_dim", "block_size", "num_q_heads", "num_kv_heads")
ATTENTION_KINDS = ("paged_decode", "paged_prefill")
# Optional fields only some kinds read. Set for any other kind they would be silently ignored,
# so loading refuses them there and canonical() leaves them out.
FIELD_KINDS: dict[tuple[str, str], tuple[str, ...]] = {
    ("attention", "softmax_scale"): ATTENTION_KINDS,
    ("attention", "sliding_window"): ATTENTION_KINDS,
    ("attention", "logits_soft_cap"): ATTENTION_KINDS,
    ("attention", "alibi"): ATTENTION_KINDS,
    ("attention", "causal"): ("paged_prefill",),  # a decode query is the last position: causal by nature
    ("attention", "sinks"): ATTENTION_KINDS,
    ("attention", "sparse_topk"): ATTENTION_KINDS,
    ("dtype", "out"): ATTENTION_KINDS,
}
# ---------------------------------------------------------------- models

_CONFIG = ConfigDict(extra="forbid", strict=True, frozen=True)
_HEADS = f"1..{MAX_HEADS}"
_POS = "a positive number (fits in fp32)"
_TAIL_HINT = ("; true masks the unused slots of each sequence's last block, "
              "false promises every length is a multiple of block_size")

# Field types: the pydantic type and Field bounds feed the JSON Schema; the _Check does the validating.
HeadCount = Annotated[int, Field(ge=1, le=MAX_HEADS), _int(1, MAX_HEADS, f"must be in {_HEADS}", _HEADS)]
HeadDim = Annotated[int, Field(ge=32, le=576, multiple_of=8),
                    _int(32, 576, "must be a multiple of 8 in 32..576", "32, 40, 48, …, 576", lambda v: v % 8 == 0)]
BlockSize = Annotated[int, Field(ge=1, le=256),
                      _int(1, 256, "must be a power of two in 1..256", "1, 2, 4, …, 256", lambda v: v & (v - 1) == 0)]
Window = Annotated[int, Field(ge=1, le=INT32_MAX),
                   _int(1, INT32_MAX, "must be a positive number of tokens", "1..2147483647, or null")]
PosInt = Annotated[int, Field(ge=1, le=INT32_MAX), _int(1, INT32_MAX, "must be a positive integer", "1..2147483647")]
Bool = Annotated[bool, _bool()]
Scalar = Annotated[bool | int | float | str, BeforeValidator(_Check(_check_scalar, _SCALAR_ALLOWED))]
ParamName = Annotated[str, _c_name("threads")]
Constraint = Annotated[str, BeforeValidator(_Check(_check_constraint, _EXPR_ALLOWED))]
Buckets = Annotated[list[PosInt], Field(min_length=1), _list("a non-empty list of positive integers")]
ParamValues = Annotated[list[Scalar], Field(min_length=1), _list(f"a non-empty list of {_SCALAR_ALLOWED}")]
Targets = Annotated[list[Annotated[Arch, _one_of(Arch, suggest=False)]],
                    Field(min_length=1, json_schema_extra={"uniqueItems": True}), _list(", ".join(ARCHS))]


class AttentionSpec(BaseModel):
    model_config = _CONFIG
    num_q_heads: HeadCount = Field(description="number of query heads")
    num_kv_heads: HeadCount = Field(description="number of KV heads; divides num_q_heads (GQA; 1 = MQA)")
    head_dim: HeadDim = Field(description="size of one q/K head, a multiple of 8 in 32..576 (also V's unless "
                                          "v_head_dim says otherwise)")
    softmax_scale: Annotated[Literal["auto"] | float, _positive(f"auto or {_POS}", auto=True)] = Field(
        "auto", description="auto = 1/sqrt(head_dim), or a positive number (paged_decode and paged_prefill only)")
    sliding_window: Window | None = Field(
        None, description="attend to the last W tokens only (null = no window; paged_decode and paged_prefill only)")
    logits_soft_cap: Annotated[float, Field(gt=0), _positive(f"{_POS}, or null")] | None = Field(
        None, description="soft cap: logits become cap * tanh(s / cap) (null = off; paged_decode and paged_prefill only)")
    alibi: Bool = Field(
        False, description="add ALiBi biases; slopes are passed at call time (paged_decode and paged_prefill only)")
    causal: Bool = Field(True, description=(
        "causal masking of the query chunk (paged_prefill only; a decode query sees every key anyway)"))
    sinks: Bool = Field(False, description=(
        "learned per-head sink logits, passed at call time as `sinks` [num_q_heads] fp32 "
        "(paged_decode and paged_prefill only)"))
    v_head_dim: HeadDim | None = Field(None, description=(
        "V and output head dim when it differs from head_dim (null = head_dim); layouts separate and mla"))
    sparse_topk: PosInt | None = Field(None, description=(
        "token-level sparse attention: each query row attends only to the N cache slots its `indices` row "
        "names (null = dense; layout mla; no causal mask or window; paged_decode and paged_prefill only)"))


class KVCacheSpec(BaseModel):
    model_config = _CONFIG
    block_size: BlockSize = Field(description="tokens per KV block, a power of two in 1..256")
    layout: Annotated[Layout, _one_of(Layout)] = Field(
        description="separate K and V arrays, one fused array, or vLLM's split-vector layout")
    order: Annotated[Order, _one_of(Order)] | None = Field(
        None, description="axis order inside a block for separate/fused (default NHD); not allowed with vllm")
    dtype: Annotated[KVDType, _one_of(KVDType)] = Field(description="element type stored in the cache")
    scale: Annotated[Scale, _one_of(Scale)] = Field(
        "none", description="dequantization scale granularity; required for fp8/int8, must be none otherwise")

    @property
    def resolved_order(self) -> Literal["NHD", "HND", "vllm"]:
        return "vllm" if self.layout == "vllm" else (self.order or "NHD")

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_KV_DTYPES


class DTypeSpec(BaseModel):
    model_config = _CONFIG
    q: Annotated[QDType, _one_of(QDType)] = Field(description="query (and cache_write key/value) element type")
    out: Annotated[QDType, _one_of(QDType)] | None = Field(
        None, description="output element type (default: q; paged_decode and paged_prefill only)")

    @property
    def resolved_out(self) -> str:
        return self.out or self.q


class BucketSpec(BaseModel):
    model_config = _CONFIG
    batch: Buckets = Field(description="batch sizes to tune for")
    context: Buckets = Field(description="context lengths to tune for")


class TuningSpec(BaseModel):
    model_config = _CONFIG
    params: Annotated[dict[ParamName, ParamValues], _mapping("a mapping from parameter name to a list of values")] = (
        Field(description="the search space: parameter name -> candidate values"))
    constraints: Annotated[list[Constraint], _list(
        "a list of expressions", "; leave tuning.constraints out when there are none")] = Field(
        default_factory=list, description=f"expressions every tried config satisfies ({_EXPR_ALLOWED})")
    defaults: Annotated[dict[ParamName, Scalar], _mapping("a mapping from parameter name to one of its values")] = (
        Field(default_factory=dict, description="the config used without tuning"))
    buckets: BucketSpec | None = Field(None, description="problem sizes the tuner picks a config for")


class Spec(BaseModel):
    """One kernel. Load with load_spec / parse_spec / spec_from_dict to get kgen-worded errors."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, title="kgen spec")
    kgen: Annotated[Literal[1], BeforeValidator(_Check(lambda v: _check_version(v), "1"))] = Field(
        description="spec format version")
    name: Annotated[str, Field(pattern=_NAME_RE.pattern), _c_name("llama3_8b_decode")] = Field(
        description="C identifier naming the kernel, unique within one build")
    kind: Annotated[Kind, _one_of(Kind)] = Field(description="which kernel family to generate")
    attention: AttentionSpec = Field(description="attention shape and math")
    kv_cache: KVCacheSpec = Field(description="paged KV cache format")
    dtype: DTypeSpec = Field(description="query/output element types")
    tail_masking: Annotated[bool, _bool(_TAIL_HINT)] = Field(description=(
        "required: true masks the last partial block; false promises lengths are multiples of block_size"))
    targets: Targets = Field(default_factory=lambda: list(DEFAULT_TARGETS), description="CUDA archs to compile for")
    tuning: TuningSpec | None = Field(None, description="optional autotuning space")

    _source_path: Path | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _cross_field(self) -> Spec:
        # The fields as given (as the loader sees them): a default must not count as "set for this kind".
        problems = _semantic_errors(self.model_dump(exclude_unset=True), set())
        if problems:
            msg = "; ".join(f"{_dotted(loc)}: {m}" for loc, m in problems)
            raise PydanticCustomError("kgen_semantic", "{msg}", {"msg": msg})
        return self

    @property
    def source_path(self) -> Path | None:
        return self._source_path

    @property
    def group_size(self) -> int:
        return self.attention.num_q_heads // self.attention.num_kv_heads

    @property
    def v_head_dim_value(self) -> int:
        """V's and the output's head dim (head_dim unless attention.v_head_dim says otherwise)."""
        return self.attention.v_head_dim or self.attention.head_dim

    @property
    def softmax_scale_value(self) -> float:
        s = self.attention.softmax_scale
        return 1.0 / math.sqrt(self.attention.head_dim) if s == "auto" else float(s)

    def canonical(self) -> dict[str, Any]:
        """Plain JSON data: every field this kind reads, defaults filled in; absent values (null, empty
        optional lists and mappings) and fields the kind does not read are left out, so loading it
        (spec_from_dict, or parse_spec of its YAML) gives an equal spec back."""
        data = _present(self.model_dump(mode="json"), Spec)
        if self.kv_cache.layout not in ("vllm", "mla"):  # those layouts fix their own order
            data["kv_cache"]["order"] = self.kv_cache.resolved_order
        data["dtype"]["out"] = self.dtype.resolved_out
        if not self.attention.sinks:  # the default: left out, so specs written before sinks keep their hash
            data["attention"].pop("sinks", None)
        for (section, name), readers in FIELD_KINDS.items():
            if self.kind not in readers:
                data[section].pop(name, None)
        return data

    def spec_hash(self) -> str:
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def __eq__(self, other: object) -> bool:
        """Equal specs describe the same kernel: the same canonical form. How the file spelled it
        (a default written out or left implicit) and where it came from do not count."""
        if not isinstance(other, Spec):
            return NotImplemented
        return self.spec_hash() == other.spec_hash()

    def __hash__(self) -> int:
        return hash(self.spec_hash())

    def with_overrides(self, **changes: Any) -> Spec:
        """A re-validated variant. Sections merge (`kv_cache={"block_size": 32}` keeps the other
        kv_cache fields); dotted keys reach one field (`**{"kv_cache.block_size": 32}`)."""
        data = self.model_dump(exclude_unset=True)  # defaults stay implicit: they follow a changed kind
        for key, value in changes.items():
            head, *rest = key.split(".")
            for part in reversed(rest):
                value = {part: value}
            _merge(data, {head: value}, Spec)
        spec = spec_from_dict(data, filename=f"{self.name} (overrides)")
        spec._source_path = self._source_path
        return spec


def _check_version(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        _fail(f"must be the integer 1, not {_kind(v)}", v, "1")
    if v != 1:
        _fail("unsupported spec format version; this kgen reads version 1", v, "1")
    return v


def _submodel(annotation: Any) -> type[BaseModel] | None:
    for t in (annotation, *get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _model_at(loc: Loc) -> type[BaseModel] | None:
    cls: type[BaseModel] | None = Spec
    for part in loc:
        field = cls.model_fields.get(part) if cls and isinstance(part, str) else None
        cls = _submodel(field.annotation) if field else None
    return cls


def _present(data: dict[str, Any], cls: type[BaseModel]) -> dict[str, Any]:
    """`data` without null values and without empty optional lists and mappings, section by section."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        field = cls.model_fields[key]
        if value is None or (not field.is_required() and isinstance(value, list | dict) and not value):
            continue
        sub = _submodel(field.annotation)
        out[key] = _present(value, sub) if sub and isinstance(value, dict) else value
    return out


def _merge(base: dict[str, Any], changes: dict[str, Any], cls: type[BaseModel]) -> None:
    for key, value in changes.items():
        field = cls.model_fields.get(key)
        sub = _submodel(field.annotation) if field else None
        if sub and isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value, sub)  # a section: merge; a dict-valued field (params): replace
        else:
            base[key] = value


def _dotted(loc: Loc) -> str:
    return ".".join(map(str, loc))


# ---------------------------------------------------------------- cross-field rules

_INVALID = object()  # a field that failed its own validation: rules that read it stay quiet


def _getter(data: dict[str, Any], bad: set[Loc]) -> Callable[..., Any]:
    def get(*path: str, default: Any = None) -> Any:
        if any(b[: len(path)] == path or path[: len(b)] == b for b in bad):
            return _INVALID
        node: Any = data
        for part in path:
            if node is None:
                return default
            if not isinstance(node, dict):
                return _INVALID
            node = node.get(part)
        return default if node is None else node
    return get


def _same(a: object, b: object) -> bool:
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _duplicates(values: Any, loc: Loc, what: str) -> list[tuple[Loc, str]]:
    if not isinstance(values, list):
        return []
    return [(loc + (i,), f"duplicate {what} (got {_show(v)} again; allowed: each value once)")
            for i, v in enumerate(values) if any(_same(v, w) for w in values[:i])]


def _semantic_errors(data: dict[str, Any], bad: set[Loc]) -> list[tuple[Loc, str]]:
    get = _getter(data, bad)
    out: list[tuple[Loc, str]] = []
    q, kv = get("attention", "num_q_heads"), get("attention", "num_kv_heads")
    if isinstance(q, int) and isinstance(kv, int) and q % kv:
        divisors = ", ".join(str(d) for d in range(1, q + 1) if q % d == 0)
        out.append((("attention", "num_kv_heads"),
                    f"must divide attention.num_q_heads (GQA) (got {kv} with num_q_heads {q}; allowed: {divisors})"))

    targets = get("targets")
    defaulted = targets is None
    targets = list(DEFAULT_TARGETS) if defaulted else targets
    out += _duplicates(targets, ("targets",), "target")
    uses: dict[str, list[Loc]] = {}
    for loc in (("dtype", "q"), ("dtype", "out"), ("kv_cache", "dtype")):
        value = get(*loc)
        if isinstance(value, str) and value in MIN_SM:
            uses.setdefault(value, []).append(loc)
    for dt, locs in uses.items() if isinstance(targets, list) else ():
        need = MIN_SM[dt]
        old = sorted({t for t in targets if int(t[3:]) < need}, key=ARCHS.index)
        if old:
            also = f" (also set by {', '.join(map(_dotted, locs[1:]))})" if locs[1:] else ""
            ok = ", ".join(a for a in ARCHS if int(a[3:]) >= need)
            got = ("the default targets " if defaulted else "targets ") + ", ".join(targets)
            out.append((locs[0], f"{dt}{also} needs every target to be sm_{need} or newer; "
                                 f"{' and '.join(old)} {'is' if len(old) == 1 else 'are'} older (got {got}; allowed: {ok})"))

    kv_dtype, scale = get("kv_cache", "dtype"), get("kv_cache", "scale")
    if kv_dtype in SELF_SCALED_KV_DTYPES:
        if scale in SCALES[1:]:
            out.append((("kv_cache", "scale"), f"{kv_dtype} caches carry their own scales "
                                               f"({SELF_SCALED_KV_DTYPES[kv_dtype]}); leave scale out "
                                               f"(got {scale!r}; allowed: none)"))
    elif kv_dtype in QUANTIZED_KV_DTYPES and scale in (None, "none"):
        shown = "none (the default)" if scale is None else "'none'"
        out.append((("kv_cache", "scale"), f"{kv_dtype} KV caches need a scale granularity "
                                           f"(got {shown}; allowed: per_tensor, per_head, per_token_head)"))
    elif kv_dtype in KV_DTYPES and kv_dtype not in QUANTIZED_KV_DTYPES and scale in SCALES[1:]:
        out.append((("kv_cache", "scale"), f"{kv_dtype} KV caches are not quantized, so they take no scale "
                                           f"(got {scale!r}; allowed: none)"))
    order = get("kv_cache", "order")
    if get("kv_cache", "layout") == "vllm" and order in ORDERS:
        out.append((("kv_cache", "order"), "the vllm layout fixes its own order; leave order out "
                                           f"(got {order!r}; allowed: no order with layout vllm)"))
    return out + _format_errors(get) + _kind_errors(get) + _sparse_errors(get) + _tuning_errors(get)


def _format_errors(get: Callable[..., Any]) -> list[tuple[Loc, str]]:
    """What the cache format cannot combine: a V head dim of its own, the MLA layout, nvfp4."""
    out: list[tuple[Loc, str]] = []
    layout, kv_dtype = get("kv_cache", "layout"), get("kv_cache", "dtype")
    head_dim, v_dim = get("attention", "head_dim"), get("attention", "v_head_dim")
    if isinstance(v_dim, int) and layout in LAYOUTS and layout not in V_HEAD_DIM_LAYOUTS:
        out.append((("attention", "v_head_dim"), f"a V head dim of its own needs K and V in pools of their own; "
                    f"the {layout} layout keeps them at one width (got v_head_dim {v_dim} with layout {layout}; "
                    f"allowed: layout {' or '.join(V_HEAD_DIM_LAYOUTS)}, or no v_head_dim)"))
    if layout == "mla":
        kv_heads = get("attention", "num_kv_heads")
        if isinstance(kv_heads, int) and kv_heads != 1:
            out.append((("attention", "num_kv_heads"), "the mla layout holds one latent row per token, shared by "
                        f"every query head (got {kv_heads}; allowed: 1)"))
        if v_dim is None and isinstance(head_dim, int):
            out.append((("attention", "v_head_dim"), "the mla layout reads V as the first v_head_dim elements of "
                        f"each latent row, so v_head_dim must be given and be below head_dim (got none with "
                        f"head_dim {head_dim}; allowed: a multiple of 8 in 32..{head_dim - 8}, e.g. 512 for 576)"))
        elif isinstance(v_dim, int) and isinstance(head_dim, int) and v_dim >= head_dim:
            out.append((("attention", "v_head_dim"), "the mla layout reads V as the first v_head_dim elements of "
                        f"each latent row, so v_head_dim must be below head_dim (got {v_dim} with head_dim "
                        f"{head_dim}; allowed: a multiple of 8 in 32..{head_dim - 8})"))
        order = get("kv_cache", "order")
        if order in ORDERS:
            out.append((("kv_cache", "order"), "the mla layout has one row per token and no head axis; leave order "
                        f"out (got {order!r}; allowed: no order with layout mla)"))
        if get("kv_cache", "scale") == "per_head":
            out.append((("kv_cache", "scale"), "the mla layout has one latent head: its scales are per_tensor or "
                        "per token (got 'per_head'; allowed: per_tensor, per_token_head)"))
        if get("kind") in ATTENTION_KINDS and get("attention", "softmax_scale", default="auto") == "auto":
            out.append((("attention", "softmax_scale"), "the mla layout needs the model's softmax scale as a number: "
                        "1/sqrt(head_dim) of the latent row is not the model's (got auto; allowed: a positive number, "
                        "e.g. 1/sqrt(192) = 0.07216878 for DeepSeek-V3)"))
    if kv_dtype == "fp8_ds_mla":
        out += _ds_mla_errors(get, layout)
    if kv_dtype == "nvfp4":
        if layout in LAYOUTS and layout not in NVFP4_LAYOUTS:
            out.append((("kv_cache", "layout"), f"{kv_dtype} packs two values a byte with a scale per 16, which the "
                        f"{layout} layout cannot hold (got {layout!r}; allowed: {', '.join(NVFP4_LAYOUTS)})"))
        for loc, dim in ((("attention", "head_dim"), head_dim), (("attention", "v_head_dim"), v_dim)):
            if isinstance(dim, int) and dim % 32:
                out.append((loc, f"a {kv_dtype} cache stores whole 16-element scale groups in whole bytes, so the "
                                 f"head dim must be a multiple of 32 (got {dim}; allowed: 32, 64, 96, …)"))
    return out


def _ds_mla_errors(get: Callable[..., Any], layout) -> list[tuple[Loc, str]]:
    """fp8_ds_mla is one row format: the mla layout at head_dim 576 / v_head_dim 512, bf16 queries."""
    out: list[tuple[Loc, str]] = []
    if layout in LAYOUTS and layout != "mla":
        out.append((("kv_cache", "layout"), "fp8_ds_mla stores one 656-byte latent row per token (512 e4m3, 4 fp32 "
                    f"scales, 64 bf16 rope), which only the mla layout holds (got {layout!r}; allowed: mla)"))
    for field, want in DS_MLA_DIMS.items():
        got = get("attention", field)
        if isinstance(got, int) and got != want:
            out.append((("attention", field), f"fp8_ds_mla rows hold 512 latent values and 64 rope values: {field} "
                        f"must be {want} (got {got}; allowed: {want})"))
    q = get("dtype", "q")
    if isinstance(q, str) and q in Q_DTYPES and q != "bf16":
        out.append((("dtype", "q"), "fp8_ds_mla rows keep the rope part in bf16 and the kernels dequantize to bf16 "
                    f"operands: q (and cache_write's input rows) must be bf16 (got {q}; allowed: bf16)"))
    return out


def _kind_errors(get: Callable[..., Any]) -> list[tuple[Loc, str]]:
    """Fields the spec's kind would ignore, and the window/causal rule of paged_prefill."""
    kind = get("kind")
    if kind not in KINDS:
        return []
    out: list[tuple[Loc, str]] = []
    for loc, readers in FIELD_KINDS.items():
        value = get(*loc)
        if kind not in readers and value is not None and value is not _INVALID:
            who = f"only {' and '.join(readers)} {'reads' if len(readers) == 1 else 'read'} it"
            out.append((loc, f"has no effect on a {kind} kernel: {who} "
                             f"(got {_show(value)}; allowed: leave {loc[-1]} out for kind {kind})"))
    window, causal = get("attention", "sliding_window"), get("attention", "causal")
    if kind == "paged_prefill" and causal is False and isinstance(window, int):
        out.append((("attention", "sliding_window"), "a sliding window needs causal attention: with causal: "
                    f"false every query sees every key (got sliding_window {window} with causal false; "
                    "allowed: causal true, or no sliding_window)"))
    return out


def _sparse_errors(get: Callable[..., Any]) -> list[tuple[Loc, str]]:
    """What token-level sparse attention cannot combine: another layout, a causal mask, a window (the
    indices already name each row's visible keys)."""
    topk = get("attention", "sparse_topk")
    if not isinstance(topk, int) or isinstance(topk, bool):
        return []
    out: list[tuple[Loc, str]] = []
    layout = get("kv_cache", "layout")
    if layout in LAYOUTS and layout != "mla":
        out.append((("attention", "sparse_topk"), "token-level sparse attention is built for the mla layout only "
                    f"(got layout {layout!r}; allowed: layout mla, or no sparse_topk)"))
    if get("attention", "causal") is True:
        out.append((("attention", "causal"), "a sparse kernel has no causal mask: each row's indices name the keys "
                    "it sees (got causal true with sparse_topk; allowed: leave causal out, or false)"))
    window = get("attention", "sliding_window")
    if isinstance(window, int) and not isinstance(window, bool):
        out.append((("attention", "sliding_window"), "a sparse kernel has no window: each row's indices name the "
                    f"keys it sees (got sliding_window {window} with sparse_topk; allowed: no sliding_window)"))
    return out


def _tuning_errors(get: Callable[..., Any]) -> list[tuple[Loc, str]]:
    out: list[tuple[Loc, str]] = []
    for axis in ("batch", "context"):
        out += _duplicates(get("tuning", "buckets", axis), ("tuning", "buckets", axis), f"{axis} bucket")
    params = get("tuning", "params")
    if not isinstance(params, dict):
        return out
    names = ", ".join(params) or "none (tuning.params is empty)"
    for name, values in params.items():
        out += _duplicates(values, ("tuning", "params", name), f"value of {name}")
    defaults = get("tuning", "defaults")
    for key, value in defaults.items() if isinstance(defaults, dict) else ():
        loc = ("tuning", "defaults", key)
        if key not in params:
            out.append((loc, f"not a tuning parameter{_suggest(key, params)} (got {key!r}; allowed: {names})"))
        elif not any(_same(value, v) for v in params[key]):
            listed = ", ".join(map(_show, params[key]))
            out.append((loc, f"not one of the values tuning.params.{key} lists (got {_show(value)}; allowed: {listed})"))
    constraints = get("tuning", "constraints")
    for i, expr in enumerate(constraints) if isinstance(constraints, list) else ():
        known = set(params) | set(CONSTRAINT_SPEC_NAMES)
        unknown = sorted(constraint_names(expr) - known)
        if unknown:
            out.append((("tuning", "constraints", i), f"{unknown[0]!r} is not a tuning parameter or spec value"
                        f"{_suggest(unknown[0], known)} (got {expr!r}; allowed: names from tuning.params: {names}; "
                        f"spec values: {', '.join(CONSTRAINT_SPEC_NAMES)})"))
    return out


# ---------------------------------------------------------------- loading and error reporting

_TOP_KEYS = ", ".join(Spec.model_fields)


def _translate(err: Any, loc: Loc) -> str:
    kind = err["type"]
    if kind == "kgen":
        return err["ctx"]["msg"]
    if kind == "missing":
        parent = _model_at(loc[:-1])
        field = parent.model_fields.get(str(loc[-1])) if parent else None
        sub = _submodel(field.annotation) if field else None
        if sub:
            return f"missing required section (allowed: a mapping with keys {', '.join(sub.model_fields)})"
        check = next((m.func for m in (field.metadata if field else []) if isinstance(getattr(m, "func", None), _Check)), None)
        return f"missing required field{check.hint if check else ''} (allowed: {check.allowed if check else 'see kgen schema'})"
    if kind == "extra_forbidden":
        parent = _model_at(loc[:-1])
        keys = list(parent.model_fields) if parent else []
        return f"unknown key{_suggest(str(loc[-1]), keys)} (got {str(loc[-1])!r}; allowed: {', '.join(keys)})"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        sub = _model_at(loc)
        keys = ", ".join(sub.model_fields) if sub else "field names"
        return f"must be a mapping, not {_kind(err['input'])} (got {_show(err['input'])}; allowed: a mapping with keys {keys})"
    return f"{err['msg']} (got {_show(err.get('input'))})"  # not expected: every field has its own check


def _line_of(lines: dict[Loc, int], loc: Loc) -> int:
    for i in range(len(loc), -1, -1):  # a missing field takes its parent's line
        if loc[:i] in lines:
            return lines[loc[:i]]
    return 1


def _build(data: object, filename: str, doc: YamlDoc | None) -> Spec:
    lines = doc.lines if doc else None

    def line(loc: Loc, explicit: int | None = None) -> int | None:
        return explicit or (_line_of(lines, loc) if lines is not None else None)

    def render(loc: Loc, msg: str, at: int | None) -> str:
        where = filename if at is None else f"{filename}:{at}"
        return f"{where}: {_dotted(loc)}: {msg}" if loc else f"{where}: {msg}"

    if not isinstance(data, dict):
        raise SpecError([render((), f"the top level must be a mapping of spec fields, not {_kind(data)} "
                                    f"(got {_show(data)}; allowed: a mapping with keys {_TOP_KEYS})", line(()))])
    found = [(p.loc, p.message, p.line) for p in doc.problems] if doc else []
    blocked = [p.loc for p in doc.problems if p.blocks] if doc else []
    spec = None
    try:
        spec = Spec.model_validate(data)
    except ValidationError as e:
        bad: set[Loc] = set(blocked)
        for err in e.errors(include_url=False):
            if err["type"] == "kgen_semantic":
                continue  # re-derived below, with precise locations
            loc = tuple(p for p in err["loc"] if p != "[key]")
            bad.add(loc)
            if not any(loc[: len(b)] == b for b in blocked):
                found.append((loc, _translate(err, loc), None))
        found += [(loc, msg, None) for loc, msg in _semantic_errors(data, bad)]
    if found or spec is None:
        rows = [(line(loc, at), loc, msg) for loc, msg, at in found]
        rows.sort(key=lambda r: r[0] or 0)  # stable: same-line problems keep their order
        raise SpecError([render(loc, msg, at) for at, loc, msg in rows])
    return spec


def parse_spec(text: str, filename: str = "<string>") -> Spec:
    try:
        doc = read_yaml(text)
    except YamlFileError as e:
        raise SpecError([f"{filename}:{e.line}: {e.message}"]) from None
    return _build(doc.data, filename, doc)


def spec_from_dict(data: dict[str, Any], filename: str = "<dict>") -> Spec:
    return _build(data, filename, None)


def load_spec(path: str | Path) -> Spec:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise SpecError([f"{path}:1: file not found"]) from None
    except IsADirectoryError:
        raise SpecError([f"{path}:1: is a directory, not a spec file"]) from None
    except UnicodeDecodeError as e:
        raise SpecError([f"{path}:1: not UTF-8 text ({e.reason} at byte {e.start})"]) from None
    except OSError as e:
        raise SpecError([f"{path}:1: cannot read the file: {e.strerror}"]) from None
    spec = parse_spec(text, str(path))
    spec._source_path = p.resolve()
    return spec


def json_schema() -> dict[str, Any]:
    """JSON Schema of the spec format, with help text, for editors and `kgen schema`."""
    schema = Spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["description"] = "A kgen kernel spec: one YAML document per kernel (see docs/architecture.md)."
    return schema


__all__ = [
    "ARCHS", "ATTENTION_KINDS", "FIELD_KINDS", "KINDS", "KV_DTYPES", "LAYOUTS", "NVFP4_LAYOUTS", "ORDERS",
    "Q_DTYPES", "QUANTIZED_KV_DTYPES", "SCALES", "SELF_SCALED_KV_DTYPES", "V_HEAD_DIM_LAYOUTS",
    "AttentionSpec", "BucketSpec", "DTypeSpec", "KVCacheSpec", "Spec", "SpecError", "TuningSpec",
    "c_name_problem", "constraint_names", "json_schema", "load_spec", "parse_spec", "spec_from_dict",
]
