"""Text output shared by the commands (:mod:`dmltrain.text`): names, durations, cells and tables."""

from __future__ import annotations

import csv
import html
import io
import math
import re

from dmltrain.text import (
    cell,
    clip,
    csv_cell,
    csv_text,
    csv_value,
    finite_number,
    format_duration,
    markdown_table,
    md_code,
    md_text,
    md_url,
    one_line,
    printable,
    safe_name,
    visible,
)


def test_names_are_file_safe():
    assert safe_name("sop/normsoftmax v2") == "sop-normsoftmax-v2"
    assert safe_name("--my run!!") == "my-run" and safe_name("") == "run" and safe_name(None, "x") == "x"
    assert safe_name("ok_name-1.2") == "ok_name-1.2"


def test_durations():
    assert [format_duration(s) for s in (0, 4.9, 64, 3599, 3600 + 125, -3)] == [
        "0m00s",
        "0m04s",
        "1m04s",
        "59m59s",
        "1h02m",
        "0m00s",
    ]
    assert [format_duration(s, exact=True) for s in (4.9, 64, 3600 + 125)] == ["4s", "1m04s", "1h02m05s"]
    assert format_duration(None) == "—"


def test_cells_numbers_and_errors():
    assert [cell(x) for x in (None, float("nan"), float("inf"), 0.123456, 3, "a")] == [
        "—",
        "—",
        "—",
        "0.1235",
        "3",
        "a",
    ]
    assert [finite_number(x) for x in (1, 0.5, True, float("nan"), float("inf"), "1", None)] == [
        True,
        True,
        False,
        False,
        False,
        False,
        False,
    ]
    assert clip("abcdef", 4) == "abc…" and clip("abc", 4) == "abc"
    assert one_line(ValueError("first\nsecond")) == "ValueError: first" and one_line("x" * 10, 5) == "xxxx…"


def test_tables():
    head, rows = ["run", "a|b", "value"], [["r1", "x|y", 0.5], ["r2", "two\nlines", None]]
    md = markdown_table(head, rows, bold={2: {0}}, links=["http://u/1", "http://u/2"]).splitlines()
    assert md == [
        "| run | a\\|b | value |",
        "|---|---|---|",
        "| [r1](http://u/1) | x\\|y | **0.5** |",
        "| [r2](http://u/2) | two lines | — |",
    ]
    parsed = list(csv.reader(io.StringIO(csv_text(head, [["r1", "x|y", 1 / 3], ["r2", None, math.pi]]))))
    assert parsed == [head, ["r1", "x|y", repr(1 / 3)], ["r2", "", repr(math.pi)]]
    assert float(parsed[1][2]) == 1 / 3  # every digit kept


def test_untrusted_text_is_inert_in_markdown_csv_and_paths():
    assert md_text("<img src=x onerror=alert(1)> & [a](javascript:b) *c* `d` e|f") == (
        "&lt;img src=x onerror=alert(1)&gt; &amp; \\[a\\](javascript:b) \\*c\\* \\`d\\` e\\|f"
    )
    assert md_text("sample_ratio _x_") == "sample_ratio \\_x\\_"  # only an underscore that could emphasize
    # bare URLs and www. names, which GitHub's Markdown links by itself: split by a character reference, shown alike
    for name in ("https://evil.example/login", "see www.evil.example now", "HTTP://x.example", "a ftp://b/c"):
        inert = md_text(name)
        assert not re.search(r"(?i)://|\bwww\.", inert), inert
        assert html.unescape(inert) == name
    assert md_text("a: b // c, wwwx.y") == "a: b // c, wwwx.y"  # not a URL: left alone
    assert md_code("a``b") == "```a``b```" and md_code("`x") == "`` `x ``" and md_code("two\nlines") == "`two lines`"
    assert md_url('http://u/#/x?a=[1] (y) "z" <w>') == "http://u/#/x?a=[1]%20%28y%29%20%22z%22%20%3Cw%3E"
    assert [csv_cell(x) for x in ("=1+2", "+a", "-a", "@a", "\tx", "-0.5", "+1e3", "a=b", 3, -2, None)] == [
        "'=1+2", "'+a", "'-a", "'@a", "'\tx", "-0.5", "+1e3", "a=b", "3", "-2", ""
    ]  # fmt: skip
    # read back (shards build --exclude): the guard taken off, anything else as it was
    for x in ("=1+2", "+a", "-a", "@a", "\tx", "-0.5", "a=b", "'quoted", "'=kept", "plain"):
        assert csv_value(csv_cell(x)) == x, x
    # the one rule for text others wrote, on a terminal and in Markdown: one line, no control characters
    hostile = "a\x1b[31mb\r\nc\td\x07\u202ee\u200bf\x00 ° × é"
    assert visible(hostile) == "a[31mb c def ° × é" == printable(hostile, None)
    assert md_code(hostile) == "`a[31mb c def ° × é`" and printable("x" * 400)[-2:] == "x…"
    assert [safe_name(x) for x in ("..", ".", ".hidden", "../../etc", "a..b", "v1.")] == [
        "run", "run", "hidden", "etc", "a..b", "v1"
    ]  # fmt: skip
