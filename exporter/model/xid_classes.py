"""XID classes, and the operator's overrides of them (``--xid-class``).

A leaf of ``model``, so that parsing flags (``exporter.config``) needs no analysis: the
catalogue of codes and their classes is in exporter/analysis/xid.py.
"""

from __future__ import annotations

APPLICATION, WARNING, FATAL, UNKNOWN = "application", "warning", "fatal", "unknown"
CLASSES = (APPLICATION, WARNING, FATAL, UNKNOWN)
SEVERITIES = CLASSES  # the older word for the same four classes
OVERRIDABLE = (APPLICATION, WARNING, FATAL)

# The codes --xid-class accepts. NVIDIA's Xid catalog numbers them from 1 and lists
# fewer than 200 today (https://docs.nvidia.com/deploy/xid-errors/); the ceiling leaves
# room for new ones and keeps a 20-digit typo out.
XID_MIN, XID_MAX = 1, 65535


def parse_overrides(text: str) -> dict[int, str]:
    """``"13=fatal,94=warning"`` -> ``{13: "fatal", 94: "warning"}`` for ``--xid-class``.

    Raises ValueError with one line naming the bad item, so the CLI can print it and
    exit 2 instead of starting with a table the operator did not mean.
    """
    out: dict[int, str] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        code_text, sep, severity = (part.strip() for part in item.partition("="))
        if not sep or not code_text.isdigit():
            raise ValueError(f"--xid-class: {item!r} is not XID=CLASS (e.g. 13=fatal,94=warning)")
        if severity not in OVERRIDABLE:
            raise ValueError(
                f"--xid-class: {item!r}: class must be one of {', '.join(OVERRIDABLE)}"
            )
        code = int(code_text)
        if not XID_MIN <= code <= XID_MAX:
            raise ValueError(
                f"--xid-class: {item!r}: XID {code_text} is not in the range "
                f"{XID_MIN}..{XID_MAX} (NVIDIA's catalog numbers them from 1, below 200 today)"
            )
        if code in out and out[code] != severity:
            raise ValueError(f"--xid-class: XID {code} is given two classes")
        out[code] = severity
    return out
