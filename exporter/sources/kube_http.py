"""The HTTP requests of the Kubernetes watches: each one is one request, with a
wall-clock deadline, and can be cut from another thread.

Three things the ``kubernetes`` client and urllib3 do not give:

- **No hidden retries.** ``Configuration.retries`` left unset makes urllib3's
  ``PoolManager`` use ``Retry.DEFAULT`` (``Retry(3)``): every request is retried up to
  three times on connection and read errors, and on 413/429/503 with a ``Retry-After``
  header it sleeps as long as the header says (``Retry.respect_retry_after_header``,
  https://urllib3.readthedocs.io/en/stable/reference/urllib3.util.html), inside the call.
  One LIST of the watch's budget became four at the API server, and one
  ``Retry-After: 100000`` stopped the watch for 27 hours. ``no_retries()`` makes each call
  one request; the watch's own backoff and LIST budget pace the next.
- **A deadline on the whole request.** urllib3's read timeout bounds one read, not the
  answer: a server that sends a byte every few seconds keeps a LIST or a watch window
  open forever. ``InFlight`` cuts the connection when its deadline passes.
- **A way to cut a request that has no response yet.** A watch thread blocked while the
  server has not answered at all (a silent server) cannot be stopped by closing the
  response, for there is none. ``track_connections`` makes the client's pools note, in
  the requesting thread, the connection each request goes out on, so ``InFlight.cut``
  reaches its socket from any thread.

A cut is ``socket.shutdown(SHUT_RDWR)`` on the connection's socket, as
``kubernetes.watch.Watch.stop`` does: the blocked read returns at once, and a
``close()`` from another thread could wait on the lock the read holds.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import time
from types import TracebackType
from typing import Any

# How often a cut is repeated while the request has not ended: a connection still
# connecting has no socket yet, and a request may open one just after a cut.
CUT_REPEAT_S = 0.05

_current = threading.local()  # .flight: the InFlight of the requesting thread, if any


class DeadlineExceeded(Exception):
    """A request had no complete answer by its wall-clock deadline and was cut."""


def no_retries() -> Any:
    """urllib3's ``Retry`` for one request per call: no retry of any kind, no sleep on
    ``Retry-After``, a redirect handed back as the answer it is (the watch treats it
    as an error). urllib3 is imported here, in the watch thread, like ``kubernetes``."""
    import urllib3

    return urllib3.Retry(
        total=0, redirect=False, respect_retry_after_header=False, raise_on_status=False
    )


class _NotedConnection:
    """Hands the connection a request goes out on to the requesting thread's
    ``InFlight`` before anything is sent (a mixin for urllib3's connections)."""

    def request(self, *args: Any, **kwargs: Any) -> None:
        flight: InFlight | None = getattr(_current, "flight", None)
        if flight is not None:
            flight.attach(self)
        super().request(*args, **kwargs)  # type: ignore[misc]


@functools.cache
def _noting_pools() -> dict[str, type]:
    """urllib3's two pool classes, with connections that note themselves."""
    from urllib3.connection import HTTPConnection, HTTPSConnection
    from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

    http = type("NotedHTTPConnection", (_NotedConnection, HTTPConnection), {})
    https = type("NotedHTTPSConnection", (_NotedConnection, HTTPSConnection), {})
    return {
        "http": type("NotedHTTPConnectionPool", (HTTPConnectionPool,), {"ConnectionCls": http}),
        "https": type("NotedHTTPSConnectionPool", (HTTPSConnectionPool,), {"ConnectionCls": https}),
    }


def track_connections(pool_manager: Any) -> bool:
    """Make ``pool_manager`` (an ``ApiClient``'s ``rest_client.pool_manager``) note each
    request's connection for ``InFlight``; False when it uses pools of its own (a SOCKS
    proxy), whose requests can then be cut only once their response has come."""
    from urllib3.poolmanager import pool_classes_by_scheme

    if getattr(pool_manager, "pool_classes_by_scheme", None) is not pool_classes_by_scheme:
        return False
    pool_manager.pool_classes_by_scheme = _noting_pools()
    return True


def _shutdown(connection: Any) -> None:
    sock = getattr(connection, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            # socket.socket's own shutdown, also for an SSLSocket: the TLS object stays
            # with the thread that reads, which then sees the end of the stream.
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


class InFlight:
    """One request and the reading of its answer, ended by ``deadline_s`` at the latest.

    Used as a context manager around the request and the reading, in the thread that
    makes it. ``cut()`` (any thread) ends it now; when the deadline passes, a timer
    thread cuts it, and leaving the block raises ``DeadlineExceeded`` (chained to what
    the cut made the reading raise, if anything), so a request that outlived its
    deadline is a failure, never an answer.
    """

    def __init__(self, deadline_s: float, what: str) -> None:
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.deadline_s = deadline_s
        self.what = what  # "list pods": for the message
        self._connection: Any = None
        self._response: Any = None
        self._done = threading.Event()
        self._expired = threading.Event()
        self._timer: threading.Timer | None = None
        self._began = 0.0

    @property
    def expired(self) -> bool:
        return self._expired.is_set()

    def attach(self, connection: Any) -> None:
        """The connection the request goes out on (noted before it is sent)."""
        self._connection = connection
        if self._expired.is_set():
            _shutdown(connection)

    def attach_response(self, response: Any) -> None:
        """The response: its connection, for pools that do not note theirs."""
        self._response = response
        if self._connection is None:
            self._connection = getattr(response, "connection", None)

    def cut(self) -> None:
        """End the request now: its blocked read or connect returns with an error."""
        for connection in (self._connection, getattr(self._response, "connection", None)):
            if connection is not None:
                _shutdown(connection)

    def _expire(self) -> None:
        """The timer thread: cut, and cut again until the request has ended (it may
        still be connecting, with no socket to cut)."""
        self._expired.set()
        while not self._done.is_set():
            self.cut()
            self._done.wait(CUT_REPEAT_S)

    def __enter__(self) -> InFlight:
        self._began = time.monotonic()
        timer = threading.Timer(self.deadline_s, self._expire)
        timer.name = f"deadline-{self.what}"
        timer.daemon = True
        self._timer = timer
        _current.flight = self
        timer.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _current.flight = None
        self._done.set()
        if self._timer is not None:
            self._timer.cancel()
        if self._expired.is_set() and not isinstance(exc, DeadlineExceeded):
            lasted = time.monotonic() - self._began
            raise DeadlineExceeded(
                f"no complete answer within {self.deadline_s:g} s (cut after {lasted:.1f} s)"
            ) from exc


def in_cluster() -> bool:
    """The kubelet gave this pod the API server's address (in-cluster credentials)."""
    return bool(
        os.environ.get("KUBERNETES_SERVICE_HOST") and os.environ.get("KUBERNETES_SERVICE_PORT")
    )


def bounded_api_client(kubeconfig: str | None) -> Any:
    """An ``ApiClient`` on a private ``Configuration`` (in-cluster, else the kubeconfig),
    so nothing global is touched, that makes one request per call: no urllib3 retries,
    no client-go style ``Retry-After`` retries inside a call, and each connection noted
    for ``InFlight.cut``. Used by the watches and by the writes to Kubernetes;
    ``kubernetes`` is imported here, in the calling (background) thread."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if kubeconfig is None and in_cluster():
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    else:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, client_configuration=cfg, persist_config=False
        )
    cfg.retries = no_retries()  # read by the ApiClient's pool manager when made
    cfg.client_go_retries = False  # no Retry-After retries inside a call either
    api = client.ApiClient(configuration=cfg)
    track_connections(api.rest_client.pool_manager)
    return api
