"""Serving ``--web-config-file``: TLS whose certificates rotate without a restart, basic
auth, allowed client-certificate SANs and extra response headers.

The file and the certificate files it names are checked for changes at most once a
second, on a TLS handshake or a request (exporter-toolkit re-reads on every request;
the same effect, without reading files per scrape). A change that does not load (a
half-written file during rotation) keeps the last good settings and logs one error;
the next change is tried again. Whether the listener speaks TLS at all is fixed at
start: turning TLS on or off needs a restart.

``/healthz`` and ``/readyz`` stay open without credentials, so kubelet probes need no
password (they say nothing about the node); everything else needs them when
``basic_auth_users`` is set. Passwords are checked by ``exposition/basic_auth.py``: on a
worker of its own, cached once verified, with a budget for failed logins.
"""

from __future__ import annotations

import base64
import binascii
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web

from exporter.exposition.basic_auth import BasicAuth, Verdict
from exporter.exposition.web_config import (
    WebConfig,
    WebConfigError,
    load_web_config,
    ssl_context,
)

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
CHECK_EVERY_S = 1.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class WebSecurity:
    """The current settings of one web config file, kept fresh."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self.config = load_web_config(path)  # WebConfigError: the caller exits 2
        self._context = ssl_context(self.config.tls) if self.config.tls else None
        self._stamp = self._stamps()
        self._checked_at = clock()
        self._last_error: str | None = None
        self.reloads_total = 0
        self.reload_errors_total = 0
        self.auth = BasicAuth(clock=clock)

    @property
    def tls(self) -> bool:
        return self._context is not None

    def server_context(self) -> ssl.SSLContext | None:
        """The context for the listener: each handshake first picks up a rotated
        certificate (an SNI callback swaps in the newest context)."""
        if self._context is None:
            return None
        self._context.sni_callback = self._on_handshake
        return self._context

    def refresh(self) -> None:
        """Re-read the file and its certificates if any changed (at most once a second)."""
        now = self._clock()
        if now - self._checked_at < CHECK_EVERY_S:
            return
        self._checked_at = now
        stamp = self._stamps()
        if stamp == self._stamp:
            return
        try:
            config = load_web_config(self.path)
            if (config.tls is None) != (self._context is None):
                raise WebConfigError(
                    f"{self.path}: turning TLS on or off needs a restart of the exporter"
                )
            context = ssl_context(config.tls) if config.tls else None
        except Exception as exc:  # whatever the file holds, the last good settings stay
            self.reload_errors_total += 1
            error = str(exc) if isinstance(exc, WebConfigError) else f"{self.path}: {exc!r}"
            if error != self._last_error:
                log.error("web config not reloaded, keeping the previous one: %s", error)
                self._last_error = error
            return  # stamp not taken: the next change is tried again
        self._stamp, self.config, self._last_error = stamp, config, None
        if context is not None:
            context.sni_callback = self._on_handshake
            self._context = context
        self.reloads_total += 1
        log.info("web config reloaded from %s", self.path)

    def close(self) -> None:
        """Answer queued password checks now (503), so that shutdown does not wait on them."""
        self.auth.close()

    # -- TLS ---------------------------------------------------------------------------

    def _on_handshake(
        self, conn: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None, _ctx: ssl.SSLContext
    ) -> None:
        self.refresh()
        if self._context is not None and conn.context is not self._context:
            conn.context = self._context

    def _stamps(self) -> tuple[tuple[str, float, int], ...]:
        files = [self.path, *(self.config.tls.files if self.config.tls else ())]
        out = []
        for path in files:
            try:
                st = path.stat()
                out.append((str(path), st.st_mtime, st.st_size))
            except OSError:
                out.append((str(path), -1.0, -1))
        return tuple(out)

    # -- HTTP --------------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.refresh()
        config = self.config
        if request.path not in OPEN_PATHS:
            denied = self._check_sans(request, config) or await self._check_user(request, config)
            if denied is not None:
                return denied
        response = await handler(request)
        response.headers.update(config.headers)
        return response

    def _check_sans(self, request: web.Request, config: WebConfig) -> web.Response | None:
        allowed = config.tls.client_allowed_sans if config.tls else ()
        if not allowed:
            return None
        cert = request.transport.get_extra_info("peercert") if request.transport else None
        names = {value for _kind, value in (cert or {}).get("subjectAltName", ())}
        if names & set(allowed):
            return None
        return web.Response(status=403, text="client certificate not allowed\n")

    async def _check_user(self, request: web.Request, config: WebConfig) -> web.Response | None:
        if not config.basic_auth_users:
            return None
        user, password = _basic_credentials(request.headers.get("Authorization", ""))
        verdict = await self.auth.check(
            config.basic_auth_users, user, password, request.remote or ""
        )
        if verdict is Verdict.ALLOWED:
            return None
        if verdict is Verdict.LIMITED:
            retry = str(max(1, round(self.auth.retry_after_s)))
            return web.Response(
                status=429, text="too many failed logins\n", headers={"Retry-After": retry}
            )
        if verdict is Verdict.BUSY:
            return web.Response(
                status=503, text="password checks busy\n", headers={"Retry-After": "1"}
            )
        return web.Response(
            status=401,
            text="unauthorized\n",
            headers={"WWW-Authenticate": 'Basic realm="gpu-occupancy-exporter"'},
        )


def _basic_credentials(header: str) -> tuple[str | None, str | None]:
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic" or not encoded:
        return None, None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None, None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else (None, None)
