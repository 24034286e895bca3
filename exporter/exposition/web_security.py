"""Serving ``--web-config-file``: TLS whose certificates rotate without a restart, basic
auth, allowed client-certificate SANs and extra response headers.

The file and the certificate files it names are looked at no more than once a second,
on a TLS handshake or a request (exporter-toolkit re-reads on every request; the same
effect, without reading files per scrape). Looking, reading and building run on a
thread of their own, one look at a time (a daemon: never on the executor that runs the
sample cycle, never holding up the exit): parsing a 1 MiB file takes seconds, and
requests and handshakes never wait on it; they are served with the current settings
meanwhile. A change is applied only once it has stayed the same (each
file's size, mtime and content digest) across two looks at least ``CHECK_EVERY_S``
apart, so a file caught half-written that happens to parse (the users not written yet)
is not applied. A change that does not load keeps the last good settings and logs one
error; the next change is tried again. One that loads but takes basic auth or client
certificates away is applied with a warning naming what went. Whether the listener
speaks TLS at all is fixed at start: turning TLS on or off needs a restart.

``/healthz`` and ``/readyz`` stay open without credentials, so kubelet probes need no
password (they say nothing about the node); everything else needs them when
``basic_auth_users`` is set. Passwords are checked by ``exposition/basic_auth.py``: on a
worker of its own, cached once verified, with a budget for failed logins.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import logging
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from exporter.exposition.basic_auth import BasicAuth, Verdict
from exporter.exposition.web_config import (
    MAX_FILE_BYTES,
    WebConfig,
    WebConfigError,
    load_web_config,
    mixed_cost_warning,
    read_bounded,
    ssl_context,
)

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
CHECK_EVERY_S = 1.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Per file: (path, mtime_ns, size, content digest or the reason it could not be read)
Stamp = tuple[tuple[str, int, int, str], ...]


@dataclass(frozen=True)
class _Loaded:
    stamp: Stamp
    config: WebConfig
    context: ssl.SSLContext | None


class WebSecurity:
    """The current settings of one web config file, kept fresh."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self.config = load_web_config(path)  # WebConfigError: the caller exits 2
        self._context = ssl_context(self.config.tls) if self.config.tls else None
        self._stamp = self._stamps(self.config, ())
        self._candidate: Stamp | None = None  # a change seen once, not yet applied
        self._checked_at = clock()
        self._looking: asyncio.Task[None] | None = None
        self._last_error: str | None = None
        self.reloads_total = 0
        self.reload_errors_total = 0
        self.auth = BasicAuth(clock=clock)
        _warn_costs(self.config)

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
        """Look for a change (at most once a second, one look at a time) on a worker
        thread; what it finds is applied when it is done. Never blocks."""
        now = self._clock()
        if now - self._checked_at < CHECK_EVERY_S or self._looking is not None:
            return
        self._checked_at = now
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a tool, a test): look here and now
            self._apply(self._look())
            return
        self._looking = loop.create_task(self._look_off_loop())

    async def settled(self) -> None:
        """Wait for a look in progress to be applied (tests; shutdown needs nothing)."""
        if self._looking is not None:
            await asyncio.shield(self._looking)

    def close(self) -> None:
        """Answer queued password checks now (503), so that shutdown does not wait on them."""
        self.auth.close()

    def join(self, timeout_s: float) -> None:
        """Wait for the password check under way after close() (basic_auth.PasswordWorker)."""
        self.auth.join(timeout_s)

    async def _look_off_loop(self) -> None:
        loop = asyncio.get_running_loop()
        found: asyncio.Future[_Loaded | WebConfigError | None] = loop.create_future()

        def hand_over(result: _Loaded | WebConfigError | None) -> None:
            if not found.done():
                found.set_result(result)

        def look() -> None:
            try:
                result = self._look()
            except Exception as exc:  # a bug here must not end the looking for good
                result = WebConfigError(f"{self.path}: {exc!r}")
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(hand_over, result)

        try:
            threading.Thread(target=look, name="web-config-look", daemon=True).start()
            self._apply(await found)
        finally:
            self._looking = None

    def _look(self) -> _Loaded | WebConfigError | None:
        """On the worker: None when nothing changed or a change is not yet stable; else
        the loaded settings, or why they did not load."""
        stamp = self._stamps(self.config, (*self._stamp, *(self._candidate or ())))
        if stamp == self._stamp:
            self._candidate = None  # changed and changed back: nothing to do
            return None
        if stamp != self._candidate:
            self._candidate = stamp  # first seen: apply it if it is the same next look
            return None
        try:
            config = load_web_config(self.path)
            if (config.tls is None) != (self._context is None):
                raise WebConfigError(
                    f"{self.path}: turning TLS on or off needs a restart of the exporter"
                )
            context = ssl_context(config.tls) if config.tls else None
            # the stamp of what was loaded: the files it names may differ from before
            return _Loaded(self._stamps(config, stamp), config, context)
        except Exception as exc:  # whatever the file holds, the last good settings stay
            if isinstance(exc, WebConfigError):
                return exc
            return WebConfigError(f"{self.path}: {exc!r}")

    def _apply(self, found: _Loaded | WebConfigError | None) -> None:
        if found is None:
            return
        if isinstance(found, WebConfigError):
            self.reload_errors_total += 1
            if str(found) != self._last_error:
                log.error("web config not reloaded, keeping the previous one: %s", found)
                self._last_error = str(found)
            return  # stamp not taken: the next change is tried again
        dropped = _dropped(self.config, found.config)
        self._stamp, self._candidate, self._last_error = found.stamp, None, None
        self.config = found.config
        if found.context is not None:
            found.context.sni_callback = self._on_handshake
            self._context = found.context
        self.reloads_total += 1
        log.info("web config reloaded from %s", self.path)
        if dropped:
            log.warning(
                "web config reloaded from %s WITHOUT %s, which the previous one had: "
                "if that was not meant, put it back",
                self.path,
                " and ".join(dropped),
            )
        _warn_costs(self.config)

    # -- TLS ---------------------------------------------------------------------------

    def _on_handshake(
        self, conn: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None, _ctx: ssl.SSLContext
    ) -> None:
        self.refresh()
        if self._context is not None and conn.context is not self._context:
            conn.context = self._context

    def _stamps(self, config: WebConfig, known: Stamp) -> Stamp:
        """Size, mtime and content digest of the file and the files ``config`` names,
        each read bounded (a FIFO or a huge file is a stamp saying so, not a wait); a
        file whose size and mtime are as in ``known`` is not read again."""
        digests = {(path, mtime, size): digest for path, mtime, size, digest in known}
        files = [self.path, *(config.tls.files if config.tls else ())]
        out = []
        for path in files:
            try:
                st = path.stat()
                key = (str(path), st.st_mtime_ns, st.st_size)
                digest = (
                    digests.get(key)
                    or hashlib.blake2b(
                        read_bounded(path, MAX_FILE_BYTES, "a file", "too big")
                    ).hexdigest()
                )
                out.append((*key, digest))
            except (OSError, WebConfigError) as exc:
                out.append((str(path), -1, -1, str(exc)))
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


# client_auth_type, weakest first (the others are refused at load)
_CLIENT_CERTS = ("NoClientCert", "VerifyClientCertIfGiven", "RequireAndVerifyClientCert")


def _dropped(old: WebConfig, new: WebConfig) -> list[str]:
    """What ``old`` protected /metrics with that ``new`` does not."""
    dropped = []
    if old.basic_auth_users and not new.basic_auth_users:
        dropped.append("basic_auth_users (/metrics needs no password now)")
    old_auth = old.tls.client_auth_type if old.tls else "NoClientCert"
    new_auth = new.tls.client_auth_type if new.tls else "NoClientCert"
    if _CLIENT_CERTS.index(new_auth) < _CLIENT_CERTS.index(old_auth):
        dropped.append(f"client_auth_type {old_auth} (now {new_auth})")
    if old.tls and old.tls.client_allowed_sans and not (new.tls and new.tls.client_allowed_sans):
        dropped.append("client_allowed_sans")
    return dropped


def _warn_costs(config: WebConfig) -> None:
    warning = mixed_cost_warning(config.basic_auth_users)
    if warning is not None:
        log.warning("web config: %s", warning)
