"""Reading a Kubernetes watch stream with a bound on what one line may cost.

A watch response is newline-delimited JSON, one event per line, sent as HTTP chunks for
as long as the watch stays open. The ``kubernetes`` client reads it with
``kubernetes.watch.watch.iter_resp_lines``: ``resp.stream(amt=None)`` hands over each
HTTP chunk whole, and the line is gathered in an unbounded ``bytearray`` and decoded to
``str`` before anything looks at its length, so one 300 MiB line costs 300 MiB twice
over (the chart's memory limit is 256 Mi). Here the response is read in pieces of at
most ``READ_BYTES`` (urllib3's ``HTTPResponse.stream(amt)`` reads a chunked body at most
``amt`` bytes at a time, ``read1(amt)`` a plain one) and a line longer than
``MAX_LINE_BYTES`` raises ``LineTooLong`` as soon as that many bytes are buffered: the
caller drops the connection rather than reading the rest.

``parse_event`` turns one line into a ``WatchEvent`` (its resourceVersion, which the
next watch request carries back, at most 128 bytes of ``[0-9A-Za-z._-]``), ``None`` for
a line that is malformed but leaves the stream in step (the caller skips and counts it), or raises
``StreamBroken`` for a line after which nothing in the stream can be trusted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

# No Kubernetes object comes near this: etcd refuses values over 1.5 MiB by default
# (--max-request-bytes) and the API server requests over 3 MiB. A bigger line is a
# broken or hostile peer, and this much is what reading it may cost before it is dropped.
MAX_LINE_BYTES = 16 * 1024 * 1024
READ_BYTES = 64 * 1024
EVENT_TYPES = frozenset({"ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"})
# A resourceVersion is opaque to clients, but it goes back to the server in the next
# watch URL, so it is held to what servers send: etcd's revision in decimal (a 64-bit
# integer, at most 20 digits) with room to spare. Anything else (15 MiB of digits, a
# character a URL must escape) makes the event malformed, never the next request.
MAX_RESOURCE_VERSION_BYTES = 128
_RESOURCE_VERSION = re.compile(rf"[0-9A-Za-z._-]{{1,{MAX_RESOURCE_VERSION_BYTES}}}")


class LineTooLong(Exception):
    """A watch line grew past the limit before its newline came."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"a watch line longer than {limit // (1024 * 1024)} MiB was dropped")
        self.limit = limit


class StreamBroken(Exception):
    """The stream is out of step with the watch protocol; it must be reopened."""


class WatchError(Exception):
    """An ERROR event: the server ended the watch with a ``metav1.Status`` (410 Gone when
    the watched version was compacted away). ``status``/``reason``/``body`` are named as
    ``kubernetes.client.ApiException`` names them, so errors read the same either way."""

    def __init__(self, status: int, reason: str, body: str) -> None:
        super().__init__(f"HTTP {status} {reason}")
        self.status = status
        self.reason = reason
        self.body = body


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: str  # ADDED, MODIFIED, DELETED, BOOKMARK
    obj: Mapping[str, Any]

    @property
    def resource_version(self) -> str | None:
        """``metadata.resourceVersion`` (checked by ``parse_event``); None without one."""
        metadata = self.obj.get("metadata")
        rv = metadata.get("resourceVersion") if isinstance(metadata, Mapping) else None
        return rv if isinstance(rv, str) and rv else None


def valid_resource_version(value: Any) -> bool:
    """A non-empty string of at most ``MAX_RESOURCE_VERSION_BYTES`` of [0-9A-Za-z._-]."""
    return isinstance(value, str) and _RESOURCE_VERSION.fullmatch(value) is not None


def response_chunks(resp: Any, size: int = READ_BYTES) -> Iterator[bytes]:
    """The body of a urllib3 response in pieces of at most ``size`` bytes, each handed
    over as soon as it arrives (a watch event must not wait for the next one)."""
    if getattr(resp, "chunked", False) and resp.supports_chunked_reads():
        yield from resp.stream(size, decode_content=False)
        return
    while chunk := resp.read1(size):
        yield chunk


def bounded_lines(chunks: Iterable[bytes], limit: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """Split ``chunks`` at newlines; raises ``LineTooLong`` once a line's buffered part
    exceeds ``limit``, so no more than ``limit`` plus one chunk is ever held. A last
    piece without its newline is the stream being cut mid-event: not a line."""
    buffer = bytearray()
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            if len(buffer) + end - start > limit:
                raise LineTooLong(limit)
            buffer += chunk[start:end]
            yield bytes(buffer)
            buffer.clear()
            start = end + 1
        if len(buffer) + len(chunk) - start > limit:
            raise LineTooLong(limit)
        buffer += chunk[start:]


def parse_event(line: bytes) -> WatchEvent | None:
    """One watch line -> its event; None: malformed (not JSON, an unknown type, an
    object that is not an object), to be skipped and counted.

    Raises ``WatchError`` for an ERROR event and ``StreamBroken`` for JSON that is not a
    watch event at all (no ``type`` or no ``object``): the ``kubernetes`` client fails
    on such a line too, and client-go's StreamWatcher ends the watch on any event it
    cannot decode.
    """
    if not line.strip():
        return None
    try:
        decoded = json.loads(line)
    except ValueError:  # not JSON (UnicodeDecodeError is a ValueError too)
        return None
    if not isinstance(decoded, Mapping):
        return None
    if "type" not in decoded or "object" not in decoded:
        raise StreamBroken("a watch line that is JSON but not a watch event (no type or object)")
    kind, obj = decoded["type"], decoded["object"]
    if kind == "ERROR":
        raise _error_event(obj)
    if kind not in EVENT_TYPES or not isinstance(obj, Mapping):
        return None
    metadata = obj.get("metadata")
    rv = metadata.get("resourceVersion") if isinstance(metadata, Mapping) else None
    if rv not in (None, "") and not valid_resource_version(rv):
        return None  # it would go back to the server in the next watch URL
    return WatchEvent(kind, obj)


def _error_event(obj: Any) -> Exception:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("code"), int):
        return StreamBroken("an ERROR watch event without a status code")
    return WatchError(obj["code"], str(obj.get("reason") or ""), json.dumps(obj))
