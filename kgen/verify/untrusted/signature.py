"""A hand-written kernel's parameter list against the ABI (docs/abi.md).

The CPU backend's library reports the type code of every parameter of each kernel it holds
(kgen_signature: p = pointer, i4 = int, i8 = long long, ...). A kernel whose parameters do not
match the family's argument table would be called with arguments in the wrong places; it is
refused before any case runs, naming the parameter by its ABI name, the C type the ABI gives
it, what the source declares instead, and the ABI version. Pointee types are not in the codes:
a wrong element type is caught by the matrix.
"""

from __future__ import annotations

from kgen.abi import ABI_VERSION
from kgen.errors import KgenUserError
from kgen.families.argtable import Arg
from kgen.families.base import Config
from kgen.families.registry import family_for

_SCALAR_CODES = {"int32": "i4", "int64": "i8"}
_WORDS = {"p": "a pointer", "i1": "an 8-bit integer", "u1": "an unsigned 8-bit integer", "i2": "a short",
          "u2": "an unsigned short", "i4": "an int (32-bit)", "u4": "an unsigned int (32-bit)",
          "i8": "a long long (64-bit)", "u8": "an unsigned long long (64-bit)", "f4": "a float", "f8": "a double"}


def expected_code(arg: Arg) -> str:
    return "p" if arg.pointer else _SCALAR_CODES[arg.dtype]


def describe_code(code: str) -> str:
    if code in _WORDS:
        return _WORDS[code]
    if code.startswith("b"):
        return f"a {code[1:]}-byte value (struct or array)"
    return repr(code)


def signature_problem(kernel: str, params: tuple[Arg, ...], found: tuple[str, ...]) -> str | None:
    """What is wrong with a kernel's parameter type codes (None: they match the ABI)."""
    want = [expected_code(a) for a in params]
    for i, (arg, code, got) in enumerate(zip(params, want, found, strict=False)):
        if code != got:
            return (f"kernel '{kernel}' parameter {i + 1} '{arg.name}' must be `{arg.ctype}` ({describe_code(code)}) "
                    f"under kgen ABI {ABI_VERSION}, but the source declares {describe_code(got)} there")
    if len(found) < len(want):
        arg = params[len(found)]
        return (f"kernel '{kernel}' declares {len(found)} parameters, kgen ABI {ABI_VERSION} has {len(want)}: "
                f"parameter {len(found) + 1} '{arg.name}' (`{arg.ctype}`) is missing")
    if len(found) > len(want):
        return (f"kernel '{kernel}' declares {len(found)} parameters, kgen ABI {ABI_VERSION} has {len(want)}: "
                f"parameter {len(want) + 1} ({describe_code(found[len(want)])}) and after are not part of the ABI")
    return None


def check_signature(spec, config: Config, module, origin: str) -> None:
    """KgenUserError (exit 2) when a kernel of `module` does not take the ABI's parameters.
    Modules that cannot report parameter types (a cubin) are not checked here."""
    if not hasattr(module, "signature"):
        return
    for decl in family_for(spec).kernels(spec, config):
        problem = signature_problem(decl.name, decl.params, tuple(module.signature(decl.name)))
        if problem:
            raise KgenUserError(f"{origin}: {problem} (print the exact signature with "
                                f"`kgen abi {spec.source_path or spec.name}`)")
