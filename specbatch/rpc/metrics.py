"""Prometheus plumbing for the three services, whose metrics are named after vLLM's with a
``specbatch_`` prefix: the coordinator's in coordinator/metrics.py, the draft's and the target's
in specbatch/service/metrics.py. Here: registries, buckets they share, and the /metrics server.

Every object here takes (or makes) its own ``CollectorRegistry`` and never touches
prometheus_client's global default registry: tests and ``specbatch.stack.in_process`` run the coordinator,
the draft and the target in one process, and on a shared registry their metrics of the same name
would collide (or, worse, silently mix).

docs/operations.md lists every metric, its labels and which autoscaler reads it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

from specbatch.config.options import DEFAULT_METRICS_PORTS

log = logging.getLogger(__name__)

# The HTTP port of /metrics, one per role so that all three fit on one host side by side; a
# Kubernetes pod has its own network namespace, and deploy/ uses 9090 for each. 0 turns it off.

# Buckets shared by the coordinator's and the services' metrics; batch sizes double up to the
# services' default --max-sequences (256) and beyond.
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class MetricsServer:
    """The /metrics HTTP server started by ``start_metrics_server``."""

    port: int
    _httpd: object
    _thread: threading.Thread

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve ``registry`` as Prometheus text on http://HOST:PORT/metrics (any path, in fact) from a
    daemon thread. ``port`` 0 picks a free port; the returned object's ``.port`` says which."""
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(httpd.server_address[1], httpd, thread)


def new_registry() -> CollectorRegistry:
    """A registry of one's own, with the process's memory, CPU and open files in it
    (``process_*``; Linux only), as the default registry would have had."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


def serve_metrics(registry, kind: str, host: str, port: int | None):
    """Serve /metrics; None if turned off (port 0) or, for the default port only, if it is taken.

    A port given on the command line must work: failing at start is what an operator wants. The
    default port may be taken by a second stack on the same host (``specbatch up`` twice, the test
    suite beside a demo); that stack still serves, without metrics, and says so.
    """
    chosen = DEFAULT_METRICS_PORTS[kind] if port is None else port
    if not chosen:
        return None
    try:
        server = start_metrics_server(registry, host, chosen)
    except OSError as error:
        if port is not None:
            raise SystemExit(f"cannot serve /metrics on {host}:{chosen}: {error}") from error
        log.warning("%s: no /metrics: default port %s:%d unavailable (%s); pass --metrics-port",
                    kind, host, chosen, error)
        return None
    log.info("%s: metrics on http://%s:%d/metrics", kind, host, server.port)
    return server
