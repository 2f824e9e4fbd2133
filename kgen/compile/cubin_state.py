"""What a cubin holds that outlives a launch: its writable device-global variables and its calls
into the device heap, read from the ELF file itself (section and symbol tables; no CUDA tool).

NVRTC places every variable with static storage that device code may write in `.nv.global`
(zero-initialised) or `.nv.global.init` (initialised): `__device__`/`__managed__` variables,
plain namespace-scope variables, `const` ones that are not `constexpr`, function-scope statics.
`__constant__` data lands in `.nv.constant<N>` (read-only on the device) and `__shared__` in the
block's shared memory; neither is listed. Device `malloc`/`free` (also what `new`/`delete`
compile to) are undefined symbols the driver resolves.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kgen.compile.object_check import demangle

_WRITABLE_SECTIONS = (".nv.global",)  # .nv.global and .nv.global.init
HEAP_SYMBOLS = frozenset({"malloc", "free", "__nv_aligned_device_malloc"})
_SHT_SYMTAB = 2
_SHN_UNDEF = 0


@dataclass(frozen=True)
class CubinState:
    globals: tuple[str, ...]     # writable device-global variables (demangled: `f()::n`, `ns::count`)
    heap_calls: tuple[str, ...]  # device-heap functions the cubin calls


def cubin_state(cubin: bytes) -> CubinState:
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    endian = "<" if cubin[5] == 1 else ">"
    shoff, = struct.unpack_from(endian + "Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from(endian + "HHH", cubin, 0x3A)
    sections = [struct.unpack_from(endian + "IIQQQQIIQQ", cubin, shoff + k * shentsize) for k in range(shnum)]

    def string(table: int, offset: int) -> str:
        start = sections[table][4] + offset
        return cubin[start:cubin.index(b"\0", start)].decode(errors="replace")

    names = [string(shstrndx, s[0]) for s in sections]
    writable = {k for k, name in enumerate(names) if name.startswith(_WRITABLE_SECTIONS)}
    variables, heap = [], []
    for sec in sections:
        if sec[1] != _SHT_SYMTAB:
            continue
        _name, _type, _flags, _addr, offset, size, link, _info, _align, entsize = sec
        for k in range(size // entsize):
            st_name, st_info, _other, st_shndx, _value, _size = struct.unpack_from(endian + "IBBHQQ", cubin,
                                                                                   offset + k * entsize)
            name = string(link, st_name)
            if st_shndx in writable and (st_info & 0xF) == 1:  # STT_OBJECT
                variables.append(name)
            elif st_shndx == _SHN_UNDEF and name in HEAP_SYMBOLS:
                heap.append(name)
    readable = demangle(sorted(set(variables)))
    return CubinState(tuple(readable.get(v, v) for v in sorted(set(variables))), tuple(sorted(set(heap))))
