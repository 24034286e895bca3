"""Text helpers shared by every layer (stdlib only, imports nothing from the exporter)."""

from __future__ import annotations


def one_line(text: str, limit: int = 300) -> str:
    """Whitespace collapsed, other unprintable characters escaped, and capped at
    ``limit`` characters (an ellipsis marks a cut): an error or status reason, or any
    text from outside, must fit one log line and one metric label. A newline would
    forge a second log line; NUL, other control characters, bidirectional overrides and
    lone surrogates are written as their escapes (``\\x00``, ``\\u202e``) instead.

    Only the first ``8 * limit`` characters are looked at, so a huge text costs no more
    than a long one."""
    bound = 8 * max(limit, 1)
    cut = len(text) > bound
    line = " ".join(text[:bound].split())
    if not line.isprintable():
        line = "".join(c if c.isprintable() else _escape(c) for c in line[: limit + 1])
    if len(line) <= limit and not cut:
        return line
    return line[: limit - 1] + "…"


def _escape(char: str) -> str:
    return char.encode("unicode_escape").decode("ascii")
