"""The operations port: ``/metrics`` for Prometheus, ``/healthz`` and ``/readyz`` for probes.

* ``/healthz`` (liveness): 200 while the process serves, 503 once an actor has failed (the
  process is about to exit; a supervisor should restart it).
* ``/readyz`` (readiness): 200 when the process can take requests, 503 otherwise; both answer a
  JSON object naming each check, e.g. ``{"ready": false, "checks": {"model_loaded": false,
  "consumer_assigned": false, "broker_reachable": true, "serving": true}}``.

The server runs in a thread of its own, so it answers while the event loop is busy (a model
loading, a long step); the checks it calls only read flags the pipeline keeps up to date.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)


class OpsServer:
    def __init__(
        self,
        registry: CollectorRegistry,
        readiness: Callable[[], dict[str, bool]],
        alive: Callable[[], bool],
    ):
        self.registry = registry
        self.readiness = readiness
        self.alive = alive
        self._server: ThreadingHTTPServer | None = None

    def start(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve on `port` (0: any free one); returns the port."""
        ops = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server name)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._answer(200, generate_latest(ops.registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    alive = ops.alive()
                    self._json(200 if alive else 503, {"alive": alive})
                elif path == "/readyz":
                    checks = ops.readiness()
                    ready = all(checks.values())
                    self._json(200 if ready else 503, {"ready": ready, "checks": checks})
                else:
                    self._json(404, {"error": f"no {path}: try /metrics, /healthz, /readyz"})

            def _json(self, status: int, body: dict) -> None:
                self._answer(status, json.dumps(body).encode(), "application/json")

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # probes come every few seconds: not worth a log line each

        self._server = ThreadingHTTPServer((addr, port), Handler)
        self._server.daemon_threads = True
        thread = threading.Thread(target=self._server.serve_forever, name="ops-http", daemon=True)
        thread.start()
        return self._server.server_address[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
