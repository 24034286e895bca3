from exporter.text import one_line


def test_one_line_collapses_whitespace_and_caps_the_length() -> None:
    assert one_line("  a\n\tb   c \r\n") == "a b c"
    assert one_line("x" * 300) == "x" * 300
    assert one_line("x" * 301) == "x" * 299 + "…"
    assert one_line("abc def", limit=4) == "abc…"


def test_one_line_escapes_what_would_forge_or_hide_a_line() -> None:
    assert one_line("a\nb\r\nc") == "a b c"
    assert one_line("nul\x00bell\x07") == "nul\\x00bell\\x07"
    assert one_line("evil\u202etxt.exe") == "evil\\u202etxt.exe"  # bidi override
    assert one_line("\udcff") == "\\udcff"  # a lone surrogate cannot break the log's encoding
    cut = one_line("z" * 10_000_000, 200)
    assert len(cut) == 200 and cut.endswith("…")
    escaped = one_line("\x00" * 1_000, 20)  # escapes count towards the limit
    assert len(escaped) == 20 and escaped.startswith("\\x00\\x00") and escaped.endswith("…")
