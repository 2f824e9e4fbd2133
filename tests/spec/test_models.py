"""Spec loading: every error case names FILE:LINE, the field path and what is allowed."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pydantic
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kgen.errors import SpecError
from kgen.spec.checks import C_KEYWORDS
from kgen.spec.models import (
    Spec,
    json_schema,
    load_spec,
    parse_spec,
    spec_from_dict,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [ROOT / "specs" / "llama3_8b_decode.yaml", ROOT / "specs" / "bf16_decode_b32.yaml"]

# A valid spec; the cases below replace numbered lines, so expected line numbers are easy to read.
BASE = """\
kgen: 1
name: t_decode
kind: paged_decode
attention:
  num_q_heads: 32
  num_kv_heads: 8
  head_dim: 128
kv_cache:
  block_size: 16
  layout: separate
  dtype: fp16
dtype:
  q: fp16
tail_masking: true
targets: [sm_80, sm_90]
"""


def edit(changes: dict[int, str | None], base: str = BASE) -> str:
    """Replace 1-based lines of `base`; None deletes a line, text with newlines inserts lines."""
    lines = base.splitlines()
    out = [changes.get(i + 1, line) for i, line in enumerate(lines)]
    return "\n".join(x for x in out if x is not None) + "\n"


def tuning(*lines: str) -> str:
    """BASE plus a tuning section: its first line is line 16."""
    return BASE + "tuning:\n" + "".join(f"  {x}\n" for x in lines)


def errors_of(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value) == "\n".join(info.value.errors)
    return [e.replace(str(path), "s.yaml") for e in info.value.errors]


def assert_one(errors: list[str], line: int, path: str, words: list[str]) -> str:
    assert len(errors) == 1, errors
    err = errors[0]
    prefix = f"s.yaml:{line}: {path}: " if path else f"s.yaml:{line}: "
    assert err.startswith(prefix), err
    for word in words:
        assert word in err, (word, err)
    for leak in ("pydantic", "Input should", "errors.pydantic.dev", "Value error"):
        assert leak not in err, err
    return err


FIELD_CASES = [
    # id, text, line, path, words
    ("unknown-key-typo", edit({7: "  head_dim: 128\n  head_dims: 3"}), 8, "attention.head_dims",
     ["unknown key", "did you mean 'head_dim'?", "got 'head_dims'", "allowed: num_q_heads"]),
    ("unknown-top-key", edit({14: "tail_masking: true\ntail_mask: true"}), 15, "tail_mask",
     ["unknown key", "did you mean 'tail_masking'?"]),
    ("missing-tail-masking", edit({14: None}), 1, "tail_masking",
     ["missing required field", "allowed: true, false", "multiple of block_size"]),
    ("missing-nested-uses-parent-line", edit({7: None}), 4, "attention.head_dim", ["missing required field", "576"]),
    ("missing-section", edit({12: None, 13: None}), 1, "dtype", ["missing required section", "q, out"]),
    ("head-dim-100", edit({7: "  head_dim: 100"}), 7, "attention.head_dim",
     ["must be a multiple of 8 in 32..576", "got 100", "allowed: 32, 40, 48, …, 576"]),
    ("head-dim-too-big", edit({7: "  head_dim: 584"}), 7, "attention.head_dim", ["32..576", "got 584"]),
    ("gqa-30-over-8", edit({5: "  num_q_heads: 30"}), 6, "attention.num_kv_heads",
     ["must divide attention.num_q_heads", "got 8 with num_q_heads 30", "allowed: 1, 2, 3, 5, 6, 10, 15, 30"]),
    ("heads-zero", edit({6: "  num_kv_heads: 0"}), 6, "attention.num_kv_heads", ["1..4096", "got 0"]),
    ("name-injection", edit({2: 'name: "x; system(...)"'}), 2, "name",
     ["must be a C identifier", "got 'x; system(...)'", "llama3_8b_decode"]),
    ("name-keyword", edit({2: "name: int"}), 2, "name", ["C/C++ keyword", "got 'int'"]),
    ("name-reserved", edit({2: "name: __kernel"}), 2, "name", ["reserved", "__"]),
    ("name-too-long", edit({2: "name: " + "a" * 65}), 2, "name", ["at most 64 characters"]),
    ("name-number", edit({2: "name: 123"}), 2, "name", ["must be a C identifier, not an integer", "got 123"]),
    ("name-newline", edit({2: 'name: "ok\\n#include <x>"'}), 2, "name", ["must be a C identifier"]),
    ("bf16-sm75", edit({13: "  q: bf16", 15: "targets: [sm_75, sm_80]"}), 13, "dtype.q",
     ["bf16 needs every target to be sm_80 or newer", "sm_75 is older", "got targets sm_75, sm_80",
      "allowed: sm_80, sm_86"]),
    ("bf16-kv-sm75", edit({11: "  dtype: bf16", 15: "targets: [sm_75]"}), 11, "kv_cache.dtype", ["bf16", "sm_80"]),
    ("bf16-q-and-kv-reported-once", edit({11: "  dtype: bf16", 13: "  q: bf16", 15: "targets: [sm_75]"}), 13,
     "dtype.q", ["also set by kv_cache.dtype"]),
    ("fp8-sm80", edit({11: "  dtype: fp8_e4m3\n  scale: per_tensor", 15: "targets: [sm_80, sm_90]"}), 11,
     "kv_cache.dtype", ["fp8_e4m3 needs every target to be sm_89 or newer", "sm_80 is older",
                        "allowed: sm_89, sm_90, sm_100, sm_120"]),
    ("fp8-default-targets", edit({11: "  dtype: fp8_e5m2\n  scale: per_head", 15: None}), 11, "kv_cache.dtype",
     ["got the default targets sm_80, sm_90"]),
    ("int8-scale-none", edit({11: "  dtype: int8\n  scale: none"}), 12, "kv_cache.scale",
     ["int8 KV caches need a scale granularity", "got 'none'", "allowed: per_tensor, per_head, per_token_head"]),
    ("int8-scale-omitted", edit({11: "  dtype: int8"}), 8, "kv_cache.scale", ["got none (the default)"]),
    ("fp16-per-head", edit({11: "  dtype: fp16\n  scale: per_head"}), 12, "kv_cache.scale",
     ["fp16 KV caches are not quantized", "got 'per_head'", "allowed: none"]),
    ("vllm-with-order", edit({10: "  layout: vllm\n  order: NHD"}), 11, "kv_cache.order",
     ["vllm layout fixes its own order", "got 'NHD'"]),
    ("string-for-int", edit({7: '  head_dim: "128"'}), 7, "attention.head_dim",
     ["must be an integer, not a string", "got '128'", "drop the quotes"]),
    ("bool-for-int", edit({9: "  block_size: true"}), 9, "kv_cache.block_size",
     ["must be an integer, not true/false", "got true"]),
    ("float-for-int", edit({6: "  num_kv_heads: 8.0"}), 6, "attention.num_kv_heads", ["must be an integer, not a number"]),
    ("int-for-bool", edit({14: "tail_masking: 1"}), 14, "tail_masking", ["must be true or false, not an integer"]),
    ("int-for-enum", edit({10: "  layout: 3"}), 10, "kv_cache.layout", ["not an integer", "separate, fused, vllm"]),
    ("list-for-string", edit({3: "kind: [paged_decode]"}), 3, "kind", ["not a list"]),
    ("kgen-2", edit({1: "kgen: 2"}), 1, "kgen", ["unsupported spec format version", "got 2", "allowed: 1"]),
    ("kgen-true", edit({1: "kgen: true"}), 1, "kgen", ["must be the integer 1, not true/false"]),
    ("enum-typo", edit({11: "  dtype: fp8e4m3"}), 11, "kv_cache.dtype",
     ["unknown value", "did you mean 'fp8_e4m3'?", "allowed: fp16, bf16, fp32, fp8_e4m3, fp8_e5m2, int8"]),
    ("order-lowercase", edit({10: "  layout: separate\n  order: nhd"}), 11, "kv_cache.order", ["did you mean 'NHD'?"]),
    ("scale-nan", edit({7: "  head_dim: 128\n  softmax_scale: .nan"}), 8, "attention.softmax_scale", ["finite", "nan"]),
    ("scale-inf", edit({7: "  head_dim: 128\n  softmax_scale: .inf"}), 8, "attention.softmax_scale", ["finite"]),
    ("scale-negative", edit({7: "  head_dim: 128\n  softmax_scale: -0.5"}), 8, "attention.softmax_scale",
     ["positive", "got -0.5", "auto"]),
    ("scale-yaml-exponent", edit({7: "  head_dim: 128\n  softmax_scale: 1e-3"}), 8, "attention.softmax_scale",
     ["not a string", "1.0e-3"]),
    ("scale-word", edit({7: "  head_dim: 128\n  softmax_scale: automatic"}), 8, "attention.softmax_scale",
     ["must be a number", "auto or a positive number"]),
    ("soft-cap-zero", edit({7: "  head_dim: 128\n  logits_soft_cap: 0"}), 8, "attention.logits_soft_cap", ["positive"]),
    ("window-zero", edit({7: "  head_dim: 128\n  sliding_window: 0"}), 8, "attention.sliding_window",
     ["positive number of tokens"]),
    ("alibi-string", edit({7: "  head_dim: 128\n  alibi: maybe"}), 8, "attention.alibi", ["true or false"]),
    ("target-unknown", edit({15: "targets: [sm_80, sm_70]"}), 15, "targets.1", ["unknown value", "got 'sm_70'", "sm_75"]),
    ("target-block-list-line", edit({15: "targets:\n  - sm_80\n  - sm_70"}), 17, "targets.1", ["unknown value"]),
    ("target-duplicate", edit({15: "targets: [sm_80, sm_80]"}), 15, "targets.1", ["duplicate target"]),
    ("targets-empty", edit({15: "targets: []"}), 15, "targets", ["must not be empty"]),
    ("targets-string", edit({15: "targets: sm_80"}), 15, "targets", ["must be a list, not a string"]),
    ("section-not-mapping", edit({4: "attention: 5", 5: None, 6: None, 7: None}), 4, "attention",
     ["must be a mapping, not an integer", "num_q_heads, num_kv_heads, head_dim"]),
    ("section-null", edit({12: "dtype:", 13: None}), 12, "dtype", ["must be a mapping, not null"]),
    ("duplicate-key", edit({9: "  block_size: 16\n  block_size: 32"}), 10, "kv_cache.block_size",
     ["duplicate key", "line 9 already sets it"]),
    ("duplicate-top-key", edit({3: "kind: paged_decode\nkind: paged_prefill"}), 4, "kind", ["duplicate key", "line 3"]),
    ("non-string-key", edit({7: "  head_dim: 128\n  1: 2"}), 8, "attention", ["keys must be field names"]),
    ("unknown-yaml-tag", edit({2: "name: !cpp foo"}), 2, "name", ["unreadable YAML value", "!cpp"]),
    ("tuning-param-name", tuning("params: {bad-name: [1]}"), 17, "tuning.params.bad-name", ["C identifier"]),
    ("tuning-param-keyword", tuning("params: {class: [1]}"), 17, "tuning.params.class", ["keyword"]),
    ("tuning-empty-list", tuning("params: {threads: []}"), 17, "tuning.params.threads", ["must not be empty"]),
    ("tuning-duplicate-value", tuning("params: {threads: [64, 64]}"), 17, "tuning.params.threads.1",
     ["duplicate value of threads", "got 64"]),
    ("tuning-value-injection", tuning("params:", "  mode: [fast, 'a;b']"), 18, "tuning.params.mode.1",
     ["got 'a;b'", "names"]),
    ("tuning-value-nan", tuning("params: {x: [.nan]}"), 17, "tuning.params.x.0", ["finite"]),
    ("constraint-call", tuning("params: {threads: [64]}", "constraints: ['len(threads) > 1']"), 18,
     "tuning.constraints.0", ["uses a function call", "allowed: parameter names, numbers"]),
    ("constraint-attribute", tuning("params: {threads: [64]}", "constraints: ['threads.real > 1']"), 18,
     "tuning.constraints.0", ["an attribute access"]),
    ("constraint-power", tuning("params: {threads: [64]}", "constraints: ['threads ** 2 > 1']"), 18,
     "tuning.constraints.0", ["uses **"]),
    ("constraint-syntax", tuning("params: {threads: [64]}", "constraints: ['threads >']"), 18,
     "tuning.constraints.0", ["not a valid expression"]),
    ("constraint-not-string", tuning("params: {threads: [64]}", "constraints: [3]"), 18,
     "tuning.constraints.0", ["must be an expression in a string"]),
    ("constraint-unknown-name", tuning("params: {threads: [64]}", "constraints: ['thread >= 32']"), 18,
     "tuning.constraints.0", ["'thread' is not a tuning parameter", "did you mean 'threads'?"]),
    ("defaults-unknown", tuning("params: {threads: [64]}", "defaults: {thread: 64}"), 18, "tuning.defaults.thread",
     ["not a tuning parameter", "did you mean 'threads'?"]),
    ("defaults-not-listed", tuning("params: {threads: [64, 128]}", "defaults: {threads: 32}"), 18,
     "tuning.defaults.threads", ["not one of the values", "got 32", "allowed: 64, 128"]),
    ("defaults-bool-is-not-int", tuning("params: {flag: [1, 2]}", "defaults: {flag: true}"), 18,
     "tuning.defaults.flag", ["got true"]),
    ("tuning-typo", tuning("params: {threads: [64]}", "constraint: []"), 18, "tuning.constraint",
     ["unknown key", "did you mean 'constraints'?"]),
    ("tuning-missing-params", tuning("defaults: {}"), 16, "tuning.params", ["missing required field"]),
    ("buckets-zero", tuning("params: {}", "buckets: {batch: [1, 0], context: [128]}"), 18, "tuning.buckets.batch.1",
     ["positive integer"]),
    ("buckets-empty", tuning("params: {}", "buckets: {batch: [1], context: []}"), 18, "tuning.buckets.context",
     ["must not be empty"]),
    ("constraints-empty", tuning("params: {threads: [64]}", "constraints: []"), 18, "tuning.constraints",
     ["must not be empty", "leave tuning.constraints out when there are none"]),
    ("scale-beyond-fp32", edit({7: "  head_dim: 128\n  softmax_scale: 1.0e+39"}), 8, "attention.softmax_scale",
     ["must be positive and fit in fp32", "allowed: auto or a positive number (fits in fp32)"]),
    # Fields a kind does not read are refused, not ignored.
    ("causal-on-decode", edit({7: "  head_dim: 128\n  causal: true"}), 8, "attention.causal",
     ["has no effect on a paged_decode kernel", "only paged_prefill reads it", "got true",
      "allowed: leave causal out for kind paged_decode"]),
    ("causal-false-on-decode", edit({7: "  head_dim: 128\n  causal: false"}), 8, "attention.causal",
     ["paged_decode", "got false"]),
    ("causal-on-cache-write", edit({3: "kind: cache_write", 7: "  head_dim: 128\n  causal: true"}), 8,
     "attention.causal", ["has no effect on a cache_write kernel", "only paged_prefill reads it"]),
    ("window-on-cache-write", edit({3: "kind: cache_write", 7: "  head_dim: 128\n  sliding_window: 64"}), 8,
     "attention.sliding_window", ["has no effect on a cache_write kernel",
                                  "only paged_decode and paged_prefill read it", "got 64"]),
    ("alibi-on-copy-blocks", edit({3: "kind: copy_blocks", 7: "  head_dim: 128\n  alibi: false"}), 8,
     "attention.alibi", ["has no effect on a copy_blocks kernel", "leave alibi out for kind copy_blocks"]),
    ("scale-on-copy-blocks", edit({3: "kind: copy_blocks", 7: "  head_dim: 128\n  softmax_scale: auto"}), 8,
     "attention.softmax_scale", ["copy_blocks", "got 'auto'"]),
    ("soft-cap-on-cache-write", edit({3: "kind: cache_write", 7: "  head_dim: 128\n  logits_soft_cap: 30"}), 8,
     "attention.logits_soft_cap", ["cache_write", "got 30"]),
    ("out-on-cache-write", edit({3: "kind: cache_write", 13: "  q: fp16\n  out: fp32"}), 14, "dtype.out",
     ["has no effect on a cache_write kernel", "got 'fp32'", "leave out out for kind cache_write"]),
    ("prefill-window-not-causal", edit({3: "kind: paged_prefill", 7: "  head_dim: 128\n  sliding_window: 256\n"
                                                                   "  causal: false"}), 8,
     "attention.sliding_window", ["a sliding window needs causal attention",
                                  "got sliding_window 256 with causal false", "allowed: causal true, or no"]),
]


@pytest.mark.parametrize(("text", "line", "path", "words"), [c[1:] for c in FIELD_CASES],
                         ids=[c[0] for c in FIELD_CASES])
def test_each_problem_gives_one_located_message(tmp_path, text, line, path, words):
    assert_one(errors_of(tmp_path, text), line, path, words)


def test_message_format_matches_the_issue_example(tmp_path):
    errs = errors_of(tmp_path, edit({9: "  block_size: 24"}))
    assert errs == ["s.yaml:9: kv_cache.block_size: must be a power of two in 1..256 (got 24; allowed: 1, 2, 4, …, 256)"]


def test_unknown_key_without_a_close_match_has_no_suggestion(tmp_path):
    err = assert_one(errors_of(tmp_path, edit({15: "targets: [sm_80]\nzzzz: 1"})), 16, "zzzz", ["unknown key"])
    assert "did you mean" not in err


def test_all_errors_of_a_file_are_reported_together_in_line_order(tmp_path):
    text = edit({
        1: "kgen: 2",
        5: "  num_q_heads: 30",
        7: "  head_dim: 100",
        9: "  block_size: 24",
        11: "  dtype: int8",
        13: "  q: bf16",
        14: "tail_masking: true\ntail_masking: false",
        15: "targets: [sm_75, sm_75]\nextra: 1",
    })
    got = [(e.split(":")[1], e.split(": ")[1]) for e in errors_of(tmp_path, text)]
    assert got == [
        ("1", "kgen"),
        ("6", "attention.num_kv_heads"),
        ("7", "attention.head_dim"),
        ("8", "kv_cache.scale"),
        ("9", "kv_cache.block_size"),
        ("13", "dtype.q"),
        ("15", "tail_masking"),
        ("16", "targets.1"),
        ("17", "extra"),
    ]


def test_a_field_error_does_not_hide_cross_field_errors(tmp_path):
    # head_dim fails on its own; the GQA rule still runs, but rules reading a broken field stay quiet.
    errs = errors_of(tmp_path, edit({5: '  num_q_heads: "x"', 6: "  num_kv_heads: 8", 7: "  head_dim: 100",
                                     11: "  dtype: int8"}))
    assert [e.split(": ")[1] for e in errs] == ["attention.num_q_heads", "attention.head_dim", "kv_cache.scale"]


FILE_CASES = [
    ("empty", "", 1, ["empty"]),
    ("only-comments", "# nothing here\n", 1, ["empty"]),
    ("syntax-error", "kgen: 1\nname: [a\nkind: x\n", 3, ["YAML syntax error", "line 2"]),
    ("bad-indent", "kgen: 1\n  name: x\n", 2, ["YAML syntax error", "mapping values are not allowed"]),
    ("tab", "kgen: 1\n\tname: x\n", 2, ["YAML syntax error"]),
    ("two-documents", "kgen: 1\n---\nkgen: 1\n", 2, ["YAML syntax error", "single document"]),
    ("top-level-list", "- kgen\n- 1\n", 1, ["top level must be a mapping", "not a list", "allowed: a mapping with keys kgen"]),
    ("top-level-scalar", "# a comment\nhello\n", 2, ["top level must be a mapping", "got 'hello'"]),
]


@pytest.mark.parametrize(("text", "line", "words"), [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_file_level_problems(tmp_path, text, line, words):
    assert_one(errors_of(tmp_path, text), line, "", words)


def test_file_not_found(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(missing)
    assert info.value.errors == [f"{missing}:1: file not found"]


def test_directory_and_non_utf8(tmp_path):
    with pytest.raises(SpecError, match=r":1: is a directory"):
        load_spec(tmp_path)
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(SpecError, match=r"latin1.yaml:1: not UTF-8 text"):
        load_spec(bad)


def test_recursive_alias_is_reported_not_looped(tmp_path):
    errs = errors_of(tmp_path, edit({15: "targets: &t [*t]"}))
    assert any(e.startswith("s.yaml:15: targets.0: a YAML alias refers to itself") for e in errs), errs


def _laughs(levels: int, width: int = 10) -> list[str]:
    """A billion-laughs alias bomb: level i lists `width` aliases of level i-1 (width**levels values)."""
    rows = ["l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    rows += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
    return rows


@pytest.mark.parametrize("where", ["top", "tuning"])
def test_alias_bomb_is_refused_once_and_fast(tmp_path, where):
    rows = _laughs(9)  # 10**9 values once expanded
    if where == "top":
        text = BASE + "bomb:\n" + "".join(f"  {r}\n" for r in rows)
    else:
        text = tuning("params:", *(f"  {r}" for r in rows))
    start = time.perf_counter()
    errs = errors_of(tmp_path, text)
    assert time.perf_counter() - start < 5
    err = assert_one(errs, int(errs[0].split(":")[1]), "",
                     ["the YAML expands to more than 10000 values through aliases",
                      "anchor on this line", "write the values out"])
    anchor = int(err.split(":")[1])
    assert text.splitlines()[anchor - 1].lstrip().startswith("l"), err  # points at an anchor of the bomb


def test_deep_nesting_is_refused_once(tmp_path):
    errs = errors_of(tmp_path, BASE + "deep: " + "[" * 40 + "]" * 40 + "\n")
    assert_one(errs, 16, "", ["the YAML nests more than 32 levels deep"])
    nested = tuning("params:", "  a: &a " + "[" * 30 + "1" + "]" * 30, "  b: [" + ", ".join(["*a"] * 50) + "]")
    assert len(errors_of(tmp_path, nested)) == 1


def test_a_few_aliases_are_still_fine():
    spec = parse_spec(edit({11: "  dtype: &d bf16", 13: "  q: *d\n  out: *d"}))
    assert (spec.dtype.q, spec.dtype.out, spec.kv_cache.dtype) == ("bf16", "bf16", "bf16")


def test_messages_spell_dtypes_the_kgen_way(tmp_path):
    texts = [edit({7: "  head_dim: 128\n  logits_soft_cap: 1.0e-40"}), edit({7: "  head_dim: 128\n  softmax_scale: 1.0e+39"}),
             edit({7: "  head_dim: 128\n  logits_soft_cap: foo"})]
    for err in [e for t in texts for e in errors_of(tmp_path, t)]:
        assert not re.search(r"float(16|32|64)|bfloat16|float8", err), err
    assert not re.search(r"float(16|32|64)\b", json.dumps(json_schema())), "schema text"


def test_parse_spec_uses_the_given_filename():
    with pytest.raises(SpecError) as info:
        parse_spec(edit({9: "  block_size: 24"}), "specs/llama.yaml")
    assert info.value.errors[0].startswith("specs/llama.yaml:9: kv_cache.block_size: ")


def test_spec_from_dict_reports_paths_without_lines():
    data = yaml.safe_load(edit({9: "  block_size: 24", 14: None}))
    with pytest.raises(SpecError) as info:
        spec_from_dict(data, filename="variant")
    assert [e.split(": ")[:2] for e in info.value.errors] == [["variant", "kv_cache.block_size"],
                                                             ["variant", "tail_masking"]]


# ---------------------------------------------------------------- valid specs and the public surface


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load(path):
    spec = load_spec(path)
    assert spec.name == path.stem
    assert spec.kind == "paged_decode"
    assert spec.source_path == path.resolve()
    assert spec.tail_masking is True
    assert spec.targets == ["sm_80", "sm_90"]
    assert spec.tuning is not None and spec.tuning.defaults["threads"] in spec.tuning.params["threads"]


def test_example_values():
    llama, bf16 = (load_spec(p) for p in EXAMPLES)
    assert (llama.group_size, llama.kv_cache.resolved_order, llama.dtype.resolved_out) == (4, "NHD", "fp16")
    assert llama.tuning.params == {"threads": [64, 128, 256], "partition_size": [0, 64, 256]}
    assert llama.tuning.constraints == ["threads >= 32"]
    assert math.isclose(llama.softmax_scale_value, 128 ** -0.5)
    assert (bf16.group_size, bf16.kv_cache.resolved_order, bf16.kv_cache.block_size) == (8, "HND", 32)
    assert (bf16.attention.head_dim, bf16.dtype.q, bf16.kv_cache.dtype) == (64, "bf16", "bf16")


def test_defaults_and_resolution():
    spec = parse_spec(edit({15: None}))
    assert spec.targets == ["sm_80", "sm_90"]
    assert spec.kv_cache.order is None and spec.kv_cache.resolved_order == "NHD"
    assert spec.kv_cache.scale == "none" and not spec.kv_cache.quantized
    assert spec.dtype.out is None and spec.dtype.resolved_out == "fp16"
    a = spec.attention
    assert (a.softmax_scale, a.sliding_window, a.logits_soft_cap, a.alibi, a.causal) == ("auto", None, None, False, True)
    assert spec.tuning is None and spec.source_path is None
    vllm = parse_spec(edit({10: "  layout: vllm"}))
    assert vllm.kv_cache.resolved_order == "vllm"


def test_explicit_numbers_and_optional_fields():
    # causal belongs to paged_prefill (a decode spec refuses it; see the causal-on-decode case).
    spec = parse_spec(edit({7: "  head_dim: 64\n  softmax_scale: 1\n  sliding_window: 4096\n  logits_soft_cap: 30\n"
                               "  alibi: true", 11: "  dtype: int8\n  scale: per_token_head"}))
    a = spec.attention
    assert isinstance(a.softmax_scale, float) and spec.softmax_scale_value == 1.0
    assert (a.sliding_window, a.logits_soft_cap, a.alibi, a.causal) == (4096, 30.0, True, True)
    assert spec.kv_cache.quantized
    prefill = parse_spec(edit({3: "kind: paged_prefill", 7: "  head_dim: 64\n  causal: false"}))
    assert prefill.attention.causal is False


def test_fields_a_kind_reads_are_accepted():
    window = parse_spec(edit({3: "kind: paged_prefill", 7: "  head_dim: 64\n  sliding_window: 128\n  causal: true"}))
    assert (window.attention.sliding_window, window.attention.causal) == (128, True)
    assert "causal" in window.canonical()["attention"]
    for kind in ("cache_write", "copy_blocks"):  # null is the same as leaving the field out
        spec = parse_spec(edit({3: f"kind: {kind}", 7: "  head_dim: 64\n  sliding_window: null",
                                13: "  q: fp16\n  out: null"}))
        assert set(spec.canonical()["attention"]) == {"num_q_heads", "num_kv_heads", "head_dim"}
        assert set(spec.canonical()["dtype"]) == {"q"}
    assert "causal" not in parse_spec(BASE).canonical()["attention"]


def test_changing_the_kind_refuses_fields_the_new_kind_ignores():
    decode = parse_spec(edit({7: "  head_dim: 64\n  sliding_window: 128"}))
    with pytest.raises(SpecError, match=r"attention\.sliding_window: has no effect on a cache_write kernel"):
        decode.with_overrides(kind="cache_write")
    write = decode.with_overrides(kind="cache_write", **{"attention.sliding_window": None})
    assert write.kind == "cache_write" and write.attention.sliding_window is None
    assert write.with_overrides(kind="paged_prefill").attention.causal is True  # defaults follow the kind


@pytest.mark.parametrize("kind", ["paged_decode", "paged_prefill", "cache_write", "copy_blocks"])
def test_every_kind_parses(kind):
    assert parse_spec(edit({3: f"kind: {kind}"})).kind == kind


def test_canonical_is_plain_resolved_and_round_trips():
    for path in EXAMPLES:
        spec = load_spec(path)
        canon = spec.canonical()
        assert json.loads(json.dumps(canon)) == canon
        assert "source_path" not in json.dumps(canon)
        again = spec_from_dict(canon)
        assert again.canonical() == canon and again.spec_hash() == spec.spec_hash()
    spec = parse_spec(edit({15: None}))
    canon = spec.canonical()
    assert canon["kv_cache"]["order"] == "NHD" and canon["dtype"]["out"] == "fp16"
    assert canon["targets"] == ["sm_80", "sm_90"]
    assert spec_from_dict(parse_spec(edit({10: "  layout: vllm"})).canonical()).kv_cache.order is None


def test_spec_hash_ignores_spelling_and_source_but_not_content(tmp_path):
    explicit = edit({10: "  layout: separate\n  order: NHD", 13: "  q: fp16\n  out: fp16"})
    path = tmp_path / "k.yaml"
    path.write_text(BASE)
    base_hash = parse_spec(BASE).spec_hash()
    assert re.fullmatch(r"[0-9a-f]{64}", base_hash)
    assert load_spec(path).spec_hash() == base_hash == parse_spec(explicit).spec_hash()
    assert parse_spec(edit({9: "  block_size: 32"})).spec_hash() != base_hash


def test_with_overrides_merges_revalidates_and_keeps_source():
    spec = load_spec(EXAMPLES[0])
    variant = spec.with_overrides(kv_cache={"block_size": 32}, **{"attention.head_dim": 64})
    assert (variant.kv_cache.block_size, variant.kv_cache.layout, variant.attention.head_dim) == (32, "separate", 64)
    assert variant.attention.num_q_heads == 32 and variant.source_path == spec.source_path
    assert spec.kv_cache.block_size == 16  # the original is untouched
    assert spec.with_overrides(tuning=None).tuning is None
    with pytest.raises(SpecError, match=r"kv_cache\.block_size: must be a power of two"):
        spec.with_overrides(**{"kv_cache.block_size": 24})
    with pytest.raises(SpecError, match=r"dtype\.q: bf16 needs every target"):
        spec.with_overrides(dtype={"q": "bf16"}, targets=["sm_75"])


def test_models_are_frozen_and_enforce_rules_when_built_directly():
    spec = parse_spec(BASE)
    with pytest.raises(pydantic.ValidationError):
        spec.kv_cache.block_size = 32  # type: ignore[misc]
    data = spec.canonical()
    data["kv_cache"]["dtype"] = "int8"
    with pytest.raises(pydantic.ValidationError, match="scale granularity"):
        Spec.model_validate(data)


def test_json_schema_describes_the_format():
    schema = json_schema()
    json.dumps(schema)
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == {"kgen", "name", "kind", "attention", "kv_cache", "dtype", "tail_masking",
                                         "targets", "tuning"}
    assert set(schema["required"]) == {"kgen", "name", "kind", "attention", "kv_cache", "dtype", "tail_masking"}
    for name, sub in schema["$defs"].items():
        assert sub["additionalProperties"] is False, name
        for field, prop in sub["properties"].items():
            assert prop.get("description"), (name, field)
    for field, prop in schema["properties"].items():
        assert prop.get("description"), field
    assert schema["$defs"]["KVCacheSpec"]["properties"]["block_size"]["maximum"] == 256
    assert schema["properties"]["kind"]["enum"] == ["paged_decode", "paged_prefill", "cache_write", "copy_blocks"]


def _resolve(schema: dict, node: dict) -> dict:
    ref = node.get("$ref") or next((x["$ref"] for x in node.get("anyOf", []) if "$ref" in x), None)
    return schema["$defs"][ref.rsplit("/", 1)[1]] if ref else node


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_fit_the_schema_structure(path):
    schema = json_schema()
    data = yaml.safe_load(path.read_text())

    def check(obj: dict, node: dict, where: str) -> None:
        assert set(obj) <= set(node["properties"]), where
        assert set(node.get("required", [])) <= set(obj), where
        for key, value in obj.items():
            sub = _resolve(schema, node["properties"][key])
            if isinstance(value, dict) and "properties" in sub:
                check(value, sub, f"{where}.{key}")

    check(data, schema, "spec")


# ---------------------------------------------------------------- properties

_C_CHARS = st.text(alphabet=st.sampled_from("ab_Z09;( )\"'\n{}#/\\*-."), min_size=0, max_size=70)


@settings(max_examples=200, deadline=None)
@given(name=st.one_of(_C_CHARS, st.sampled_from(sorted(C_KEYWORDS))))
def test_any_accepted_name_is_a_safe_c_identifier(name):
    try:
        spec = spec_from_dict({**yaml.safe_load(BASE), "name": name})
    except SpecError as e:
        assert len(e.errors) == 1 and e.errors[0].startswith("<dict>: name: "), e.errors
        return
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", spec.name)
    assert spec.name not in C_KEYWORDS and not spec.name.startswith("__")


@settings(max_examples=100, deadline=None)
@given(value=st.one_of(st.integers(-(2**40), 2**40), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                       st.text(max_size=8), st.none()))
def test_block_size_accepts_only_powers_of_two(value):
    data = yaml.safe_load(BASE)
    data["kv_cache"]["block_size"] = value
    ok = type(value) is int and 1 <= value <= 256 and value & (value - 1) == 0
    try:
        spec = spec_from_dict(data)
    except SpecError as e:
        assert not ok and len(e.errors) == 1 and "kv_cache.block_size: " in e.errors[0]
    else:
        assert ok and spec.kv_cache.block_size == value


def test_constraint_may_name_spec_values():
    text = EXAMPLES[0].read_text().replace(
        'constraints: ["threads >= 32"]', 'constraints: ["threads >= 32 * group_size"]')
    assert "group_size" in text
    spec = parse_spec(text, "c.yaml")
    assert spec.tuning.constraints == ["threads >= 32 * group_size"]
    with pytest.raises(SpecError, match="'grup_size' is not a tuning parameter or spec value"):
        parse_spec(text.replace("32 * group_size", "32 * grup_size"), "c.yaml")


# ---- fp8_ds_mla: one row format (mla, 576 / 512, bf16 q, its own scales) --------------------------
DS_MLA = """\
kgen: 1
name: ds
kind: paged_decode
attention:
  num_q_heads: 16
  num_kv_heads: 1
  head_dim: 576
  v_head_dim: 512
  softmax_scale: 0.1
kv_cache:
  block_size: 64
  layout: mla
  dtype: fp8_ds_mla
dtype:
  q: bf16
tail_masking: true
targets: [sm_80, sm_90]
"""


def test_fp8_ds_mla_spec_loads(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(DS_MLA)
    assert load_spec(path).kv_cache.dtype == "fp8_ds_mla"


@pytest.mark.parametrize("changes,line,path,words", [
    ({12: "  layout: separate"}, 12, "kv_cache.layout",
     ["656-byte", "allowed: mla"]),
    ({7: "  head_dim: 560"}, 7, "attention.head_dim", ["must be 576", "got 560"]),
    ({8: "  v_head_dim: 448"}, 8, "attention.v_head_dim", ["must be 512", "got 448"]),
    ({13: "  dtype: fp8_ds_mla\n  scale: per_token_head"}, 14, "kv_cache.scale",
     ["carry their own scales", "per 128 latent values", "allowed: none"]),
    ({15: "  q: fp16"}, 15, "dtype.q", ["bf16"]),
    ({12: "  layout: mla\n  order: HND"}, 13, "kv_cache.order", ["leave order out"]),
], ids=["layout", "head_dim", "v_head_dim", "scale", "fp16-q", "order-HND"])
def test_fp8_ds_mla_refusals_are_located(tmp_path, changes, line, path, words):
    assert_one(errors_of(tmp_path, edit(changes, DS_MLA)), line, path, words)


def test_fp8_ds_mla_on_a_separate_hnd_layout_is_refused_at_the_layout(tmp_path):
    text = edit({12: "  layout: separate\n  order: HND"}, DS_MLA)
    assert_one(errors_of(tmp_path, text), 12, "kv_cache.layout", ["allowed: mla"])
