"""The operations port answers probes from its own thread, whatever the event loop is doing."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from sluice.actors.health import OpsServer


def get(port: int, path: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


def test_probes_and_metrics_on_one_port():
    registry = CollectorRegistry()
    Counter("sluice_example_total", "An example.", registry=registry).inc(3)
    checks = {"model_loaded": False, "consumer_assigned": True}
    alive = [True]
    server = OpsServer(registry, lambda: dict(checks), lambda: alive[0])
    port = server.start(0, addr="127.0.0.1")
    try:
        status, kind, body = get(port, "/readyz")
        assert status == 503 and kind == "application/json"
        assert json.loads(body) == {"ready": False, "checks": checks}
        checks["model_loaded"] = True
        status, _, body = get(port, "/readyz")
        assert status == 200 and json.loads(body)["ready"] is True

        assert get(port, "/healthz")[0] == 200
        alive[0] = False
        status, _, body = get(port, "/healthz")
        assert status == 503 and json.loads(body) == {"alive": False}

        status, kind, body = get(port, "/metrics")
        assert status == 200 and kind.startswith("text/plain")
        assert b"sluice_example_total 3.0" in body
        assert get(port, "/nothing")[0] == 404
    finally:
        server.stop()
