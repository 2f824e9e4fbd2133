"""FlashInfer-Bench's JSON documents as pydantic models, written from its documented fields
(docs/interop.md §6): Definition, Solution, Trace (with its Workload and Evaluation).

Reading is lenient where FlashInfer-Bench's versions differ (`op_type`, formerly `type`; a scalar's
`shape` null or []; unknown extra fields kept); what kgen writes is checked against the same models.
`parse_*` turn a JSON text or dict into a model or raise KgenUserError with every problem, each
named by its field path.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kgen.errors import KgenUserError

# float8_e4m3: early FlashInfer-Bench versions' name of today's float8_e4m3fn
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e4m3", "float8_e5m2", "float4_e2m1",
                 "int64", "int32", "int16", "int8", "bool")
STATUSES = ("PASSED", "INCORRECT_SHAPE", "INCORRECT_NUMERICAL", "INCORRECT_DTYPE", "RUNTIME_ERROR",
            "COMPILE_ERROR", "TIMEOUT")
NonEmpty = Field(min_length=1)


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class AxisConst(_Model):
    type: Literal["const"]
    value: int = Field(gt=0)
    description: str | None = None


class AxisVar(_Model):
    type: Literal["var"]
    parent: str | None = None
    description: str | None = None


class TensorSpec(_Model):
    shape: list[str] | None  # axis names; null (or []) for a scalar
    dtype: Literal[TENSOR_DTYPES]  # type: ignore[valid-type]
    description: str | None = None


class Definition(_Model):
    name: str = NonEmpty
    op_type: str = NonEmpty
    axes: dict[str, AxisConst | AxisVar] = Field(min_length=1)
    inputs: dict[str, TensorSpec] = Field(min_length=1)
    outputs: dict[str, TensorSpec] = Field(min_length=1)
    reference: str = NonEmpty
    tags: list[str] | None = None
    description: str | None = None
    constraints: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _older_type_field(cls, data: Any) -> Any:
        """Early FlashInfer-Bench definitions named the operator family `type`."""
        if isinstance(data, dict) and "op_type" not in data and isinstance(data.get("type"), str):
            data = {**data, "op_type": data["type"]}
            data.pop("type")
        return data

    @field_validator("reference")
    @classmethod
    def _reference_defines_run(cls, v: str) -> str:
        try:
            tree = ast.parse(v)
        except SyntaxError as e:
            raise ValueError(f"not valid Python (line {e.lineno}: {e.msg})") from None
        if not any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in tree.body):
            raise ValueError("must define a top-level function `run`")
        return v

    @model_validator(mode="after")
    def _axes_exist(self) -> Definition:
        for where, tensors in (("inputs", self.inputs), ("outputs", self.outputs)):
            for name, t in tensors.items():
                for axis in t.shape or []:
                    if axis not in self.axes:
                        raise ValueError(f"{where}.{name}.shape: axis '{axis}' is not in axes")
        return self

    def const(self, axis: str) -> int | None:
        a = self.axes.get(axis)
        return a.value if isinstance(a, AxisConst) else None


class SourceFile(_Model):
    path: str = NonEmpty
    content: str


class BuildSpec(_Model):
    language: Literal["python", "triton", "cuda"]
    target_hardware: list[str] = Field(min_length=1)
    entry_point: str = Field(pattern=r"^[^:]+\.py::[A-Za-z_][A-Za-z0-9_]*$")
    dependencies: list[str] | None = None
    build_commands: list[str] | None = None
    destination_passing_style: bool | None = None  # FlashInfer-Bench's default (absent): outputs passed in


class Solution(_Model):
    name: str = NonEmpty
    definition: str = NonEmpty
    author: str = NonEmpty
    spec: BuildSpec
    sources: list[SourceFile] = Field(min_length=1)
    description: str | None = None

    @model_validator(mode="after")
    def _entry_file_present(self) -> Solution:
        paths = [s.path for s in self.sources]
        if len(set(paths)) != len(paths):
            raise ValueError("sources: duplicate paths")
        entry = self.spec.entry_point.split("::")[0]
        if entry not in paths:
            raise ValueError(f"spec.entry_point: file '{entry}' is not among sources")
        return self


class RandomInput(_Model):
    type: Literal["random"]


class ScalarInput(_Model):
    type: Literal["scalar"]
    value: int | float | bool


class SafetensorsInput(_Model):
    type: Literal["safetensors"]
    path: str = NonEmpty
    tensor_key: str = NonEmpty


class Workload(_Model):
    axes: dict[str, int]
    inputs: dict[str, RandomInput | ScalarInput | SafetensorsInput]
    uuid: str = NonEmpty


def _error_value(v: Any) -> float:
    """A non-negative error, or NaN (written "NaN": JSON has no NaN literal)."""
    if v == "NaN":
        return math.nan
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ValueError("must be a number or \"NaN\"")
    if not math.isnan(v) and v < 0:
        raise ValueError("must be non-negative or NaN")
    return float(v)


class Correctness(_Model):
    max_relative_error: Any = 0.0
    max_absolute_error: Any = 0.0
    extra: dict[str, Any] | None = None

    @field_validator("max_relative_error", "max_absolute_error")
    @classmethod
    def _errors(cls, v: Any) -> Any:
        _error_value(v)
        return v


class Performance(_Model):
    latency_ms: float = Field(0.0, ge=0.0)
    reference_latency_ms: float = Field(0.0, ge=0.0)
    speedup_factor: float = Field(0.0, ge=0.0)


class Environment(_Model):
    hardware: str = NonEmpty
    libs: dict[str, str] = Field(default_factory=dict)


class Evaluation(_Model):
    status: Literal[STATUSES]  # type: ignore[valid-type]
    environment: Environment
    timestamp: str = NonEmpty
    log: str = ""
    correctness: Correctness | None = None
    performance: Performance | None = None

    @model_validator(mode="after")
    def _fields_by_status(self) -> Evaluation:
        wants_correctness = self.status in ("PASSED", "INCORRECT_NUMERICAL")
        if wants_correctness != (self.correctness is not None):
            raise ValueError(f"correctness must be {'present' if wants_correctness else 'absent'} "
                             f"when status is {self.status}")
        if (self.status == "PASSED") != (self.performance is not None):
            raise ValueError(f"performance must be {'present' if self.status == 'PASSED' else 'absent'} "
                             f"when status is {self.status}")
        return self


class Trace(_Model):
    definition: str = NonEmpty
    workload: Workload
    solution: str | None = None
    evaluation: Evaluation | None = None


def _problems(e: ValidationError) -> list[str]:
    out = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "union[")))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "required field is missing"
        out.append(f"{loc or '(top level)'}: {msg}")
    return list(dict.fromkeys(out))


def parse(model: type[BaseModel], data: str | dict, origin: str) -> Any:
    """`model` from a JSON text or an already-parsed dict; KgenUserError naming `origin` and each field."""
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as e:
            raise KgenUserError(f"{origin}:{e.lineno}: not valid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(data, dict):
        raise KgenUserError(f"{origin}: expected a JSON object (a FlashInfer-Bench {model.__name__}), "
                            f"got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        lines = "\n".join(f"  {p}" for p in _problems(e))
        raise KgenUserError(f"{origin}: not a valid FlashInfer-Bench {model.__name__}:\n{lines}") from None
