from exporter.text import one_line


def test_one_line_collapses_whitespace_and_caps_the_length() -> None:
    assert one_line("  a\n\tb   c \r\n") == "a b c"
    assert one_line("x" * 300) == "x" * 300
    assert one_line("x" * 301) == "x" * 299 + "…"
    assert one_line("abc def", limit=4) == "abc…"
