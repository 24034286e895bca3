"""Text helpers shared by every layer (stdlib only, imports nothing from the exporter)."""

from __future__ import annotations


def one_line(text: str, limit: int = 300) -> str:
    """Whitespace collapsed and capped at ``limit`` characters (an ellipsis marks a cut):
    an error or status reason must fit one log line and one metric label."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"
