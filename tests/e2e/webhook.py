"""A local Alertmanager webhook receiver for the e2e tests: every notification
Alertmanager posts, recorded with when it arrived and the path it was posted to (one
path per receiver when a test gives each receiver its own URL).
test_alertmanager_restart.py and test_alertmanager_routing.py use it."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Notification:
    """One POST: Alertmanager's webhook payload (receiver, status, groupLabels,
    commonLabels, alerts, ...), the URL path and the monotonic time it arrived."""

    at: float
    path: str
    payload: dict[str, Any]


@dataclass
class Webhook:
    """Every alert of every notification Alertmanager posted, with when it arrived."""

    received: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    notifications: list[Notification] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def alerts(self) -> list[tuple[float, dict[str, Any]]]:
        with self.lock:
            return list(self.received)

    def posts(self) -> list[Notification]:
        with self.lock:
            return list(self.notifications)

    def pages(self, status: str, since: float = 0.0) -> set[tuple[str, str]]:
        """(alertname, gpu) of each alert notified with ``status`` at or after ``since``."""
        return {
            (a["labels"]["alertname"], a["labels"].get("gpu", ""))
            for at, a in self.alerts()
            if a["status"] == status and at >= since
        }

    def severities(self, alertname: str) -> set[str]:
        return {
            a["labels"]["severity"]
            for _, a in self.alerts()
            if a["labels"]["alertname"] == alertname
        }


def serve_webhook(hook: Webhook) -> ThreadingHTTPServer:
    """Serve ``hook`` on 127.0.0.1 (a free port: ``server.server_address[1]``) in a
    daemon thread; ``server.shutdown()`` stops it."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            now = time.monotonic()
            payload = json.loads(body)
            with hook.lock:
                hook.received.extend((now, a) for a in payload["alerts"])
                hook.notifications.append(Notification(now, self.path, payload))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
