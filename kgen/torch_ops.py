"""`torch.ops.kgen.<spec name>`: every built kernel as a torch custom op (docs/interop.md).

The op's schema is made from the family's call arguments (kgen.families.binding.call_arguments),
so a new kind gets its op with no code here: arrays are `Tensor`, optional ones `Tensor? =None`,
arrays the call writes in place are declared mutated (`Tensor(a!)`), results are returned. The
arguments come in ABI order, the required ones first (a torch schema cannot put a required
argument after one with a default), then the optional ones.

A torch op has one return type per definition, so each op has overloads; torch picks the one
that the given arguments fit, like aten's add.Tensor / add.Scalar:

    default        (...) -> out                 cache_write / copy_blocks: -> () (written in place)
    lse            (..., *, return_lse) -> (out, lse)     chosen by return_lse=True
    out            (..., *, out) -> ()          writes the caller's buffer (an engine's preallocated out)
    scalar[_...]   k_scale / v_scale as floats  (specs with per_tensor scales)
    layers[_...]   lists of pools, one per layer (copy_blocks)

Registration: kgen never imports torch itself (`import kgen` stays cheap). kgen.build and the
generated modules register each kernel they make when torch is already imported; otherwise
call register(kernel) once torch is. The kernel registered last under a name is the one its op runs.
"""

from __future__ import annotations

import string
import sys
from dataclasses import dataclass
from typing import Any

from kgen.errors import ArgumentError
from kgen.families.base import resolve_config
from kgen.families.binding import CallArg, call_arguments
from kgen.families.registry import family_for
from kgen.formats.dtypes import BY_NAME
from kgen.optional import require

NAMESPACE = "kgen"


@dataclass(frozen=True)
class Overload:
    """One definition of an op: its overload name ("" for the default), the schema's parameter
    list, the positional parameter names, the arrays it returns and its results flag."""

    name: str
    params: str
    positional: tuple[str, ...]
    returns: tuple[CallArg, ...]
    flag: str | None = None  # return_<name>: the overload that also returns that optional result

    def schema(self, op: str) -> str:
        ret = "()" if not self.returns else "Tensor" if len(self.returns) == 1 else \
            "(" + ", ".join("Tensor" for _ in self.returns) + ")"
        return f"{op}{'.' + self.name if self.name else ''}({self.params}) -> {ret}"


def overloads(args: list[CallArg]) -> list[Overload]:
    """Every overload of an op whose call takes `args` (binding.call_arguments)."""
    taken = [a for a in args if a.use != "returned"]
    taken = [a for a in taken if not a.optional] + [a for a in taken if a.optional]
    results = tuple(a for a in args if a.use == "returned" and not a.optional)
    extras = [a for a in args if a.use == "returned" and a.optional]
    modes: list[tuple[str, list[str], tuple[CallArg, ...], str | None]] = [("", [], results, None)]
    modes += [(e.name, [f"bool return_{e.name}"], (*results, e), f"return_{e.name}") for e in extras]
    found = []
    for number in (False, True) if any(a.number for a in taken) else (False,):
        for layers in (False, True) if any(a.layers for a in taken) else (False,):
            for mode, flags, returns, flag in modes + ([("out", None, (), None)] if results else []):
                aliases = iter(string.ascii_lowercase)
                params = [_param(a, aliases, number, layers) for a in taken]
                keywords = flags if flags is not None else [f"Tensor({next(aliases)}!) {r.name}" for r in results]
                tags = ["scalar" if number else "", "layers" if layers else "", mode]
                found.append(Overload("_".join(t for t in tags if t), ", ".join(params + (["*", *keywords] if keywords
                                                                                       else [])),
                                      tuple(a.name for a in taken), returns, flag))
    return found


def _param(a: CallArg, aliases, number: bool, layers: bool) -> str:
    if number and a.number:
        kind = "float"
    else:
        kind = "Tensor" + (f"({next(aliases)}!)" if a.use == "written" else "") + ("[]" if layers and a.layers else "")
    return f"{kind}? {a.name}=None" if a.optional else f"{kind} {a.name}"


@dataclass
class _Op:
    library: Any  # the torch.library.Library holding this op's definitions
    schemas: tuple[str, ...]
    kernel: Any  # what the op runs: the kernel registered last under this name


_OPS: dict[str, _Op] = {}


def register(kernel):
    """Make `kernel` torch.ops.kgen.<its spec name> (defined once per schema; a later kernel of the
    same name replaces the one the op runs); returns the op (an OpOverloadPacket)."""
    torch = require("torch", "kgen.torch_ops", "pip install 'kgen[torch]'")
    spec = kernel.spec
    family = family_for(spec)
    config = resolve_config(family, spec, getattr(kernel, "config", None))
    name = spec.name
    ovs = overloads(call_arguments(family, spec, config))
    schemas = tuple(ov.schema(name) for ov in ovs)
    known = _OPS.get(name)
    if known is not None and known.schemas == schemas:
        known.kernel = kernel
        return getattr(torch.ops.kgen, name)
    if known is not None:  # the same name, other arguments: define the op anew
        known.library._destroy()
        torch.ops.kgen.__dict__.pop(name, None)  # the namespace caches the old op's overloads
    library = torch.library.Library(NAMESPACE, "FRAGMENT")
    for ov, schema in zip(ovs, schemas, strict=True):
        qualified = name + (f".{ov.name}" if ov.name else "")
        library.define(schema)
        library.impl(qualified, _real(name, ov), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{qualified}", _fake(ov, call_arguments(family, spec, config)),
                                    lib=library)
    _OPS[name] = _Op(library, schemas, kernel)
    return getattr(torch.ops.kgen, name)


def register_if_imported(kernel) -> None:
    """register(kernel) when torch is already imported (kgen.build and generated modules call this)."""
    if "torch" in sys.modules:
        register(kernel)


def _call(ov: Overload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The kernel's keyword arguments from an overload's arguments (None: omitted)."""
    call = {k: v for k, v in {**dict(zip(ov.positional, args, strict=False)), **kwargs}.items() if v is not None}
    if ov.flag is not None:
        if call.pop(ov.flag, False) is not True:
            raise ArgumentError(f"{ov.flag}=False: omit it instead (each overload of a torch op has one return "
                                "type; the one taking it returns the tuple)")
        call[ov.flag] = True
    return call


def _real(name: str, ov: Overload):
    def run(*args, **kwargs):
        kernel = _OPS[name].kernel
        result = kernel(**_call(ov, args, kwargs))  # on torch's current stream (kgen.runtime.placement)
        if len(ov.returns) == 1:
            return result
        return tuple(result) if ov.returns else None

    return run


def _fake(ov: Overload, table: list[CallArg]):
    """The meta implementation: the returned arrays' shapes from the sizes the inputs bind."""

    def fake(*args, **kwargs):
        call = _call(ov, args, kwargs)
        sizes: dict[str, Any] = {}
        ref = None
        for a in table:
            value = call.get(a.name)
            if isinstance(value, list | tuple):
                value = value[0] if value else None
            if a.use == "returned" or not hasattr(value, "shape"):
                continue
            ref = ref if ref is not None else value
            for symbol, size in zip(a.shape, value.shape, strict=False):
                if isinstance(symbol, str):
                    sizes.setdefault(symbol, size)
        outs = [ref.new_empty([sizes[s] if isinstance(s, str) else s for s in r.shape], dtype=_torch_dtype(r.dtype))
                for r in ov.returns]
        if len(outs) == 1:
            return outs[0]
        return tuple(outs) if outs else None

    return fake


def _torch_dtype(name: str):
    import torch

    return getattr(torch, BY_NAME[name].torch_name)
