"""Readable race reports of the CPU backend's race detection (templates/simt/kgen_simt_race.h).

The SIMT runtime names what it cannot know in tokens: `{pc:0xOFF}` (an instruction of the
kernel library, as an offset from its load address) and `{tls:0xOFF}` (a static
`__shared__` array: an offset into the library's thread-local block). `describe` turns
them into `kernel.cu:LINE `source text`` (addr2line over the library's line tables) and
the array's name (its TLS symbol), leaving a token as it is when the tools are missing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from kgen.compile.host import SOURCE_NAME, HostArtifact

# Thread orders inside a block; the numbers are kgen_simt::Schedule.
SCHEDULES = {"fifo": 1, "reverse": 2, "shuffle": 3, "mixed": 4}

_PC = re.compile(r"\{pc:0x([0-9a-f]+)\}")
_TLS = re.compile(r"\{tls:0x([0-9a-f]+)\}")


def _run(cmd: list[str]) -> str:
    if not shutil.which(cmd[0]):
        return ""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    except OSError:
        return ""
    return out.stdout if out.returncode == 0 else ""


def _source_lines(artifact: HostArtifact) -> list[str]:
    try:
        return Path(artifact.source_path).read_text().splitlines()
    except OSError:
        return []


def _locate_pcs(artifact: HostArtifact, pcs: list[str]) -> dict[str, str]:
    """{hex offset: 'kernel.cu:LINE `text`'}: the innermost frame in the kernel source
    (an access inlined from a runtime header is shown where the kernel calls it)."""
    out = _run(["addr2line", "-i", "-a", "-e", str(artifact.library), *[f"0x{p}" for p in pcs]])
    frames: dict[str, list[tuple[str, int]]] = {}
    cur = None
    for line in out.splitlines():
        if line.startswith("0x"):
            cur = frames.setdefault(f"{int(line, 16):x}", [])
            continue
        m = re.match(r"(.*):(\d+)", line.split(" (discriminator")[0])
        if cur is not None and m:
            cur.append((m.group(1), int(m.group(2))))
    src = _source_lines(artifact)
    found = {}
    for pc, fr in frames.items():
        fr = [f for f in fr if f[1] > 0]
        mine = [f for f in fr if Path(f[0]).name == SOURCE_NAME]
        if not (mine or fr):
            continue
        path, line = (mine or fr)[0]
        text = src[line - 1].strip() if mine and 0 < line <= len(src) else ""
        found[pc] = f"{Path(path).name}:{line}" + (f" `{text}`" if text else "")
    return found


def _tls_symbols(artifact: HostArtifact) -> list[tuple[int, int, str]]:
    """(offset, size, name) of the library's thread-local symbols (static __shared__ arrays)."""
    syms = []
    for line in _run(["readelf", "-sW", "-C", str(artifact.library)]).splitlines():
        parts = line.split(None, 7)
        if len(parts) == 8 and parts[3] == "TLS":
            name = parts[7].rsplit("::", 1)[-1]
            syms.append((int(parts[1], 16), int(parts[2], 0), name))
    return syms


def _name_tls(syms: list[tuple[int, int, str]], off: int) -> str:
    for start, size, name in syms:
        if start <= off < start + max(size, 1):
            return f"__shared__ '{name}' (byte {off - start})"
    return f"static __shared__ memory (thread-local offset {off})"


def describe(message: str, artifact: HostArtifact) -> str:
    """`message` with the runtime's location tokens replaced (unchanged when it has none)."""
    pcs = _PC.findall(message)
    tls = _TLS.findall(message)
    if not pcs and not tls:
        return message
    where = _locate_pcs(artifact, pcs) if pcs else {}
    message = _PC.sub(lambda m: where.get(f"{int(m.group(1), 16):x}", f"{artifact.library.name}+0x{m.group(1)}"),
                      message)
    if tls:
        syms = _tls_symbols(artifact)
        message = _TLS.sub(lambda m: _name_tls(syms, int(m.group(1), 16)), message)
    return message
