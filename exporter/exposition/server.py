"""aiohttp front end: serves bytes rendered at most once per sample cycle and format.

A scrape never touches NVML: it returns the latest cycle's text or OpenMetrics bytes
(gzip-compressed once per cycle, on first demand), rendered by the cycle itself when a
request was expected before the next one (exporter/exposition/scrape_demand.py), else
once by the first request that asks. Scrape cost does not grow with GPU count, and a slow
driver never stalls Prometheus.
"""

from __future__ import annotations

import asyncio
import gzip
import html
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from ssl import SSLContext

from aiohttp import web
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE
from prometheus_client.registry import CollectorRegistry

from exporter import __version__
from exporter.exposition.connections import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    WRITE_TIMEOUT_S,
    GuardedTCPSite,
)
from exporter.exposition.liveness import Liveness
from exporter.exposition.readiness import Readiness
from exporter.exposition.render import Renderer
from exporter.exposition.scrape_demand import ClientDemands
from exporter.exposition.web_security import WebSecurity

OPENMETRICS_MEDIA = "application/openmetrics-text"


@dataclass
class _Rendered:
    body: bytes
    gzipped: bytes | None = None

    def compressed(self) -> bytes:
        if self.gzipped is None:
            self.gzipped = gzip.compress(self.body, compresslevel=6, mtime=0)
        return self.gzipped


TEXT, OPENMETRICS = "text", "openmetrics"


class MetricsCache:
    """The latest cycle's exposition, in the formats scrapers actually ask for.

    Each cycle renders, in its worker thread, the formats a request is expected for
    before the next cycle (exporter/exposition/scrape_demand.py; text for the first
    cycles, until anyone asks): Prometheus asks for OpenMetrics once per scrape interval,
    curl for text, and rendering every format every cycle would render bodies no one
    reads. A format not rendered this cycle is rendered once on its first request.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.cycles = 0
        self._clock = clock
        self._rendered_at: float | None = None
        self._cycle_at: float | None = None
        self._registry: CollectorRegistry | None = None
        self._rendered: dict[str, _Rendered] = {}
        # text until anyone asks: as if asked once when the exporter started
        self._demand: dict[str, ClientDemands] = {TEXT: ClientDemands()}
        self._demand[TEXT].asked("", clock())
        self._lock = threading.Lock()
        # Renders asked for by a request run here, one at a time: never on the default
        # executor, where the sample cycle's reads run (a burst of first requests would
        # queue the cycle behind them).
        self._request_executor = ThreadPoolExecutor(1, thread_name_prefix="render-request")
        self._renderer = renderer = Renderer()
        self._renderers: dict[str, Callable[[CollectorRegistry], bytes]] = {
            TEXT: renderer.text,
            OPENMETRICS: renderer.openmetrics,
        }

    def due(self) -> list[str]:
        """The formats a request is expected for before the next cycle: what this
        cycle's ``render`` renders. Called once per sample cycle, before ``render``."""
        now = self._clock()
        period = None if self._cycle_at is None else now - self._cycle_at
        self._cycle_at = now
        with self._lock:
            due = [fmt for fmt, demand in self._demand.items() if demand.due(now, period)]
            lapsed = [fmt for fmt, demand in self._demand.items() if demand.lapsed(now, period)]
        for fmt in lapsed:  # no one asks for it any more: keep nothing of its last render
            self._renderer.forget(openmetrics=fmt == OPENMETRICS)
        return due

    def render(self, registry: CollectorRegistry, formats: list[str] | None = None) -> None:
        """Take this cycle's registry, rendering now ``formats`` (by default those
        ``due()`` names); called once per sample cycle."""
        due = self.due() if formats is None else formats
        rendered = {fmt: _Rendered(self._renderers[fmt](registry)) for fmt in due}
        with self._lock:
            self._registry, self._rendered = registry, rendered
            self.cycles += 1
            self._rendered_at = self._clock()

    @property
    def ready(self) -> bool:
        return self._registry is not None

    @property
    def rendered_at(self) -> float | None:
        """When the last cycle was rendered (monotonic seconds); None before the first."""
        return self._rendered_at

    def cached(self, fmt: str, client: str = "") -> _Rendered | None:
        """This cycle's bytes in ``fmt`` if already rendered (cheap, for the event loop);
        ``client`` (the peer's address) asked for them."""
        with self._lock:
            self._demand.setdefault(fmt, ClientDemands()).asked(client, self._clock())
            return self._rendered.get(fmt)

    async def for_request(self, fmt: str, *, gzipped: bool, client: str = "") -> bytes:
        """This cycle's bytes in ``fmt`` for a request, rendering (and compressing) on
        the request executor when this cycle has not yet."""
        rendered = self.cached(fmt, client)
        if rendered is None or (gzipped and rendered.gzipped is None):
            loop = asyncio.get_running_loop()
            rendered = await loop.run_in_executor(self._request_executor, self.render_now, fmt)
            if gzipped:
                return await loop.run_in_executor(self._request_executor, rendered.compressed)
        return rendered.compressed() if gzipped else rendered.body

    def render_now(self, fmt: str) -> _Rendered:
        """Render ``fmt`` for the current cycle once (blocking: run it in a thread)."""
        with self._lock:
            done = self._rendered.get(fmt)
            registry, cycle = self._registry, self.cycles
        if done is not None:
            return done
        if registry is None:
            raise RuntimeError("no cycle has been rendered yet")
        # Rendered outside the lock: the event loop takes it in cached(), and must never
        # wait for a render. Kept only if no new cycle was swapped in meanwhile.
        done = _Rendered(self._renderers[fmt](registry))
        with self._lock:
            if self.cycles == cycle:
                done = self._rendered.setdefault(fmt, done)
        return done

    def render_afresh(self) -> None:
        """Render every format from the current cycle, then each once more from nothing
        (``Renderer.forget``), so the renderer holds the families and series names of
        exactly the served output, whichever families changed since each format's last
        render. For measurements (benchmarks/soak.py), whose figures must not depend on
        when the last scrape came; blocking: run it in a thread, not on the event loop."""
        for fmt in self._renderers:
            self.render_now(fmt)
        with self._lock:
            registry = self._registry
        if registry is None:
            raise RuntimeError("no cycle has been rendered yet")
        for openmetrics in (False, True):
            self._renderer.forget(openmetrics=openmetrics)
            render = self._renderer.openmetrics if openmetrics else self._renderer.text
            render(registry)


def _quality(params: list[str]) -> float:
    """The ``q=`` weight among an Accept header entry's parameters (default 1)."""
    for param in params:
        key, _, value = param.partition("=")
        if key.strip() == "q":
            try:
                return float(value)
            except ValueError:
                return 0.0
    return 1.0


def _accepted(header: str, wanted: str) -> bool:
    """``wanted`` (a media type or coding) is listed with a non-zero quality."""
    for part in header.split(","):
        name, *params = (p.strip() for p in part.split(";"))
        if name.lower() == wanted:
            return _quality(params) > 0
    return False


def _wants_openmetrics(accept: str) -> bool:
    return _accepted(accept, OPENMETRICS_MEDIA)


def _accepts_gzip(accept_encoding: str) -> bool:
    """``gzip;q=0.5`` accepts, ``gzip;q=0`` refuses."""
    return _accepted(accept_encoding, "gzip")


DOCS_URL = "https://github.com/gpu-occupancy-exporter/gpu-occupancy-exporter/blob/main/docs"
LANDING = """<!doctype html>
<html><head><title>gpu-occupancy-exporter</title></head>
<body><h1>gpu-occupancy-exporter {version}</h1>
<p>Node {node}: GPU occupancy, attribution and health for Prometheus.</p>
<ul><li><a href="/metrics">/metrics</a></li><li><a href="/healthz">/healthz</a></li>
<li><a href="/readyz">/readyz</a></li>
<li><a href="{docs}/metrics.md">what each metric means</a></li>
<li><a href="{docs}/runbooks.md">alert runbooks</a></li></ul></body></html>
"""


def build_app(
    cache: MetricsCache,
    node_name: str,
    *,
    security: WebSecurity | None = None,
    liveness: Liveness | None = None,
    readiness: Readiness | None = None,
) -> web.Application:
    """The routes; with ``security`` (``--web-config-file``) behind its auth middleware.
    With ``liveness``, /healthz and /readyz answer 503 with its reason while no cycle
    completes (exposition/liveness.py); with ``readiness``, /readyz also answers 503 while
    the exporter cannot see the node's GPUs past its grace (exposition/readiness.py)."""

    async def metrics(request: web.Request) -> web.Response:
        if not cache.ready:
            return web.Response(status=503, text="no sample yet\n")
        openmetrics = _wants_openmetrics(request.headers.get("Accept", ""))
        fmt = OPENMETRICS if openmetrics else TEXT
        # generate_text writes the 0.0.4 text format; prometheus_client's
        # CONTENT_TYPE_LATEST now says version=1.0.0, which would mislabel it.
        content_type = OPENMETRICS_TYPE if openmetrics else CONTENT_TYPE_PLAIN_0_0_4
        headers = {"Content-Type": content_type, "Vary": "Accept, Accept-Encoding"}
        gzipped = _accepts_gzip(request.headers.get("Accept-Encoding", ""))
        if gzipped:
            headers["Content-Encoding"] = "gzip"
        body = await cache.for_request(fmt, gzipped=gzipped, client=request.remote or "")
        return web.Response(body=body, headers=headers)

    def not_live() -> web.Response | None:
        problem = liveness.problem() if liveness is not None else None
        return None if problem is None else web.Response(status=503, text=problem + "\n")

    async def healthz(request: web.Request) -> web.Response:
        return not_live() or web.Response(text="ok\n")

    async def readyz(request: web.Request) -> web.Response:
        if not cache.ready:
            return web.Response(status=503, text="waiting for the first sample\n")
        dead = not_live()
        if dead is not None:
            return dead
        blind = readiness.problem() if readiness is not None else None
        if blind is not None:
            return web.Response(status=503, text=blind + "\n")
        return web.Response(text="ready\n")

    async def landing(request: web.Request) -> web.Response:
        return web.Response(
            text=LANDING.format(
                node=html.escape(node_name), version=html.escape(__version__), docs=DOCS_URL
            ),
            content_type="text/html",
        )

    app = web.Application(middlewares=[security.middleware] if security else [])
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/", landing)
    return app


async def start_server(
    app: web.Application,
    host: str,
    port: int,
    *,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    write_timeout_s: float = WRITE_TIMEOUT_S,
    ssl_context: SSLContext | None = None,
) -> web.AppRunner:
    """Bind and start serving; raises OSError when the address is taken. Slow clients
    are held to a header deadline, a write deadline and a connection cap
    (exposition/connections.py)."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = GuardedTCPSite(
        runner,
        host or None,
        port,
        header_timeout_s=header_timeout_s,
        max_connections=max_connections,
        write_timeout_s=write_timeout_s,
        ssl_context=ssl_context,
    )
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return runner


def bound_port(runner: web.AppRunner) -> int:
    """The port actually bound (useful with port 0 in tests)."""
    for address in runner.addresses:
        if isinstance(address, tuple):
            return int(address[1])
    raise RuntimeError("server is not bound to a TCP port")
