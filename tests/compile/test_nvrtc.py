"""NVRTC compilation: cubins per arch without a GPU, ptxas resources, caching, error display."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest

from kgen.cache import ENTRY_INDEX, ArtifactCache
from kgen.compile.nvrtc import (
    CACHE_NAMESPACE,
    compile_cubin,
    format_compile_error,
    parse_ptxas_report,
)
from kgen.errors import CompileError
from kgen.render import render
from kgen.spec.models import load_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama_source():
    return render(load_spec(ROOT / "specs" / "llama3_8b_decode.yaml")).source


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compiles_each_arch_with_resources(tmp_path, llama_source, arch):
    art = compile_cubin(llama_source, arch, cache=ArtifactCache(tmp_path))
    assert art.cubin[:4] == b"\x7fELF"
    res = art.resources["llama3_8b_decode"]
    assert res.registers > 0 and f"Used {res.registers} registers" in art.log  # ptxas's own figure
    assert res.spill_stores == 0 and res.spill_loads == 0
    assert f"for '{arch}'" in art.log
    assert not art.cache_hit


def test_cache_hit_and_corrupt_entry_rebuilt(tmp_path, llama_source):
    cache = ArtifactCache(tmp_path)
    first = compile_cubin(llama_source, "sm_90", cache=cache)
    again = compile_cubin(llama_source, "sm_90", cache=cache)
    assert again.cache_hit and again.cubin == first.cubin
    cubins = list(tmp_path.rglob("kernel.cubin"))
    assert len(cubins) == 1
    cubins[0].write_bytes(b"garbage")  # corrupt the cached artifact
    rebuilt = compile_cubin(llama_source, "sm_90", cache=cache)
    assert not rebuilt.cache_hit and rebuilt.cubin == first.cubin


def _elf_end(data: bytes) -> int:
    """Where an ELF64 file must end: past its header tables, its sections and its segments."""
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    ends = [phoff + phentsize * phnum, shoff + shentsize * shnum]
    for i in range(shnum):
        _, kind, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        if kind != 8:  # SHT_NOBITS (.bss-like) takes no room in the file
            ends.append(offset + size)
    for i in range(phnum):
        _, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        ends.append(offset + filesz)
    return max(ends)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cubin_is_the_whole_elf(tmp_path, llama_source, arch):
    art = compile_cubin(llama_source, arch, cache=ArtifactCache(tmp_path))
    assert len(art.cubin) == _elf_end(art.cubin)  # CuPy's getCUBIN left it one byte short


def test_short_cubins_of_older_caches_are_not_reused(tmp_path, llama_source):
    """A cache filled before whole cubins were written holds the same key in the old namespace."""
    cache = ArtifactCache(tmp_path)
    whole = compile_cubin(llama_source, "sm_90", cache=cache).cubin
    entry = next((tmp_path / CACHE_NAMESPACE).rglob(ENTRY_INDEX)).parent
    stale = tmp_path / "cubin" / entry.relative_to(tmp_path / CACHE_NAMESPACE)
    shutil.copytree(entry, stale)
    (stale / "kernel.cubin").write_bytes(whole[:-1])
    index = json.loads((stale / ENTRY_INDEX).read_text())
    index["files"]["kernel.cubin"] = hashlib.sha256(whole[:-1]).hexdigest()
    (stale / ENTRY_INDEX).write_text(json.dumps(index))
    shutil.rmtree(entry)
    assert cache.lookup("cubin", entry.name) == stale  # an intact entry, as an older kgen left it
    again = compile_cubin(llama_source, "sm_90", cache=cache)
    assert not again.cache_hit and again.cubin == whole


def test_compile_error_shows_failing_generated_lines(tmp_path):
    source = "\n".join(["// line 1", 'extern "C" __global__ void k(float* o) {', "  o[0] = undefined_name;", "}"])
    with pytest.raises(CompileError) as e:
        compile_cubin(source, "sm_90", origin="spec demo (demo.yaml)", cache=ArtifactCache(tmp_path))
    text = str(e.value)
    assert "spec demo (demo.yaml)" in text
    assert "undefined_name" in text
    assert ">     3 |   o[0] = undefined_name;" in text


def test_parse_ptxas_report_multiple_kernels():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'a' for 'sm_90'
ptxas info    : Function properties for a
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 128 bytes smem
ptxas info    : Compiling entry function 'b' for 'sm_90'
ptxas info    : Function properties for b
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers
"""
    res = parse_ptxas_report(log)
    assert (res["a"].registers, res["a"].spill_stores, res["a"].spill_loads, res["a"].stack_frame,
            res["a"].static_smem) == (40, 8, 4, 16, 128)
    assert (res["b"].registers, res["b"].static_smem) == (12, 0)


def test_format_compile_error_without_line_info_keeps_log():
    assert "weird failure" in format_compile_error("x", "weird failure", "spec s")
