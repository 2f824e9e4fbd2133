"""A family's argument table (docs/abi.md): one row per kernel parameter, in parameter order,
and everything produced from it so the list is written once: the kernel declarations of the
template and of `kgen abi`, the argument rows of `kgen abi`, and the launcher's packing of
values into parameter order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kgen.formats.dtypes import dtype
from kgen.runtime.base import Launch

ROLES = ("input", "output", "scratch", "scalar", "stride")
_SCALARS = {"int32": (np.int32, "int"), "int64": (np.int64, "long long")}  # by-value parameters
WIDTH = 116  # wrap declarations like the hand-written templates did


@dataclass(frozen=True)
class Arg:
    """One kernel parameter."""

    name: str  # the ABI name: the C parameter name and the launcher's key
    ctype: str  # the C type exactly as the declaration spells it, e.g. "const __half*", "long long"
    role: str  # one of ROLES: input/output (arrays read/written), scratch (kgen's), scalar, stride
    shape: tuple = ()  # symbolic shape (numbers and names); () for a by-value parameter
    dtype: str = ""  # kgen dtype of the elements or of the value
    optional: bool = False  # a pointer that may be null
    doc: str = ""  # one line
    # What the template passes the kernel body for this parameter: None its name; "" nothing (another
    # parameter's expression carries it, e.g. nvfp4's tensor scale inside kgen::fp4_scales(...)).
    forward: str | None = None
    forward_ctype: str = ""  # the C type of a `forward` expression (the body's field of it in `Params`)

    @property
    def pointer(self) -> bool:
        return self.ctype.endswith("*")


def array(name: str, dtype_name: str, role: str, shape: tuple, doc: str, optional: bool = False,
          const: bool | None = None) -> Arg:
    """An array parameter; const unless it is written (or `const` says otherwise)."""
    const = role == "input" if const is None else const
    elem = _SCALARS[dtype_name][1] if dtype_name in _SCALARS else dtype(dtype_name).ctype
    return Arg(name, f"{'const ' if const else ''}{elem}*", role, tuple(shape), dtype_name, optional, doc)


def scalar(name: str, dtype_name: str, doc: str, role: str = "scalar") -> Arg:
    return Arg(name, _SCALARS[dtype_name][1], role, (), dtype_name, False, doc)


def stride(name: str, doc: str) -> Arg:
    return scalar(name, "int64", doc, role="stride")


@dataclass(frozen=True)
class KernelDecl:
    """One `extern "C" __global__` function of a family and how kgen launches it."""

    name: str
    params: tuple[Arg, ...]  # rows of the family's table, in parameter order
    grid: tuple[int | str, int | str, int | str]  # numbers, or names of sizes known at the call
    block: int  # threads per block (also the declaration's __launch_bounds__, unless max_registers)
    smem: int = 0  # dynamic shared memory, bytes
    max_registers: int = 0  # a register cap: __maxnreg__ in place of __launch_bounds__ (0: none)
    # registers a thread must be allocated at launch, exactly (0: any): a setmaxnreg split of the
    # block's registers between warpgroups counts on it (fewer, and setmaxnreg.inc waits forever)
    launch_registers: int = 0

    def declaration(self) -> str:
        bound = f"__maxnreg__({self.max_registers})" if self.max_registers else f"__launch_bounds__({self.block})"
        head = f'extern "C" __global__ void {bound} {self.name}('
        return head + "\n" + _wrap(param_decls(self.params), "    ") + ")"

    def call_args(self, names: list[str] | None = None) -> str:
        """The parameter names (or `names`: the body's order of them), comma-separated: the template
        forwards them to the kernel body, each as the body takes it (a parameter's `forward`: another
        expression, or "" for one the body does not take; a name that is no parameter stays as given)."""
        by_name = {a.name: a for a in self.params}
        shown = [n if by_name.get(n) is None or by_name[n].forward is None else by_name[n].forward
                 for n in names or [a.name for a in self.params]]
        return _wrap([s for s in shown if s != ""], "      ").lstrip()  # the template indents line 1

    def params_struct(self, name: str, absent: dict[str, tuple[str, str]] | None = None) -> str:
        """The kernel's parameters as one struct, as the body takes them: one field per parameter in
        parameter order (a `forward` one with its `forward_ctype`; none for a parameter forwarded as ""),
        so the entry fills it with `{call_args()}`. `absent`: {name: (C type, value)} of what a body reads
        that this kernel does not take, as compile-time constants (a body then needs no defaulted
        parameter for it, and the constant folds away as the default did)."""
        fields = []
        for a in self.params:
            if a.forward == "":
                continue
            ctype = a.forward_ctype if a.forward is not None else a.ctype
            if not ctype:
                raise ValueError(f"{self.name}: parameter {a.name} is forwarded as {a.forward!r} with no forward_ctype")
            fields.append(f"  {ctype} {a.name};")
        taken = {a.name for a in self.params}
        fields += [f"  static constexpr {ctype} {n} = {value};  // not a parameter of this kernel"
                   for n, (ctype, value) in (absent or {}).items() if n not in taken]
        return f"struct {name} {{  // {self.name}'s parameters as its body takes them (argument table)\n" \
            + "\n".join(fields) + "\n};"

    def geometry(self) -> str:
        return (f"grid ({', '.join(str(g) for g in self.grid)}), block ({self.block}), "
                f"dynamic shared memory {self.smem} bytes")

    def grid_for(self, sizes: dict[str, int]) -> tuple[int, int, int]:
        """The grid with its names resolved from `sizes`."""
        return tuple(int(sizes[g]) if isinstance(g, str) else g for g in self.grid)

    def launch(self, sizes: dict[str, int], values: dict[str, Any], reached: list[Any] | None = None) -> Launch:
        """The launch of this kernel: grid names resolved from `sizes`, arguments packed from `values`;
        `reached`: arrays the kernel reaches by address (see runtime.base.Launch)."""
        return Launch(self.name, self.grid_for(sizes), (self.block, 1, 1), self.smem, pack(self.params, values), list(reached or []))


def param_decls(params) -> list[str]:
    """Each parameter as the declaration spells it (pointers are __restrict__: no argument aliases another)."""
    return [f"{a.ctype} __restrict__ {a.name}" if a.pointer else f"{a.ctype} {a.name}" for a in params]


def pack(params, values: dict[str, Any]) -> list[Any]:
    """Launch arguments in parameter order: pointers as given, by-value parameters as their numpy type."""
    missing = [a.name for a in params if a.name not in values]
    if missing:
        raise KeyError(f"no launch value for parameter(s) {', '.join(missing)}")
    return [values[a.name] if a.pointer else _SCALARS[a.dtype][0](values[a.name]) for a in params]


def abi_rows(params) -> list[str]:
    """The `kgen abi` rows: name, role, C type, shape and dtype, whether it may be null, what it is."""
    rows = []
    for a in params:
        shape = "[" + ", ".join(str(s) for s in a.shape) + "]" if a.pointer else "value"
        rows.append(f"  {a.name:<18} {a.role:<7} {a.ctype:<20} {shape} {a.dtype}"
                    + (" (may be null)" if a.optional else "") + (f": {a.doc}" if a.doc else ""))
    return rows


def _wrap(items: list[str], indent: str) -> str:
    """Comma-separated items, as many per line as fit in WIDTH columns, never split."""
    lines = [indent]
    for i, item in enumerate(items):
        text = item + ("," if i < len(items) - 1 else "")
        if lines[-1] != indent and len(lines[-1]) + 1 + len(text) > WIDTH:
            lines[-1] = lines[-1].rstrip()
            lines.append(indent)
        lines[-1] += ("" if lines[-1] == indent else " ") + text
    return "\n".join(lines)
