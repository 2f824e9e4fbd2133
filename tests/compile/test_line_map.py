"""kgen/compile/line_map.py: following `#line` directives to the text a diagnostic names."""

from __future__ import annotations

from kgen.compile.line_map import display_name, find_word, numbered_lines, source_line

TEXT = '#line 1 "mine.cu"\nint a;\n#line 10\nint b;  // kgen\n#line 3 "kgen/x.cuh"\nint c;\nint kgen_d;\n'


def test_lines_are_numbered_as_the_compiler_numbers_them():
    assert list(numbered_lines(TEXT, "kernel.cu")) == [
        ("mine.cu", 1, "int a;"), ("mine.cu", 10, "int b;  // kgen"), ("kgen/x.cuh", 3, "int c;"),
        ("kgen/x.cuh", 4, "int kgen_d;")]
    assert list(numbered_lines("int a;\nint b;", "kernel.cu")) == [("kernel.cu", 1, "int a;"), ("kernel.cu", 2, "int b;")]
    assert display_name(TEXT) == "mine.cu" and display_name("int a;") is None


def test_source_line_and_find_word_follow_the_directives():
    assert source_line(TEXT, "mine.cu", 10, "kernel.cu") == "int b;  // kgen"
    assert source_line(TEXT, "kgen/x.cuh", 4, "kernel.cu") == "int kgen_d;"
    assert source_line(TEXT, "mine.cu", 2, "kernel.cu") is None  # line 2 of mine.cu is not in the text
    assert find_word(TEXT, "kgen", "kernel.cu") == ("mine.cu", 10)  # a whole word; kgen_d is not it
    assert find_word(TEXT, "c", "kernel.cu") == ("kgen/x.cuh", 3)
    assert find_word(TEXT, "absent", "kernel.cu") is None
