"""An optional Prometheus endpoint on the driver (`--metrics-port`).

A `StreamingQueryListener` reads each batch's `StreamingQueryProgress`, the same
observed metrics the Spark UI shows (`shardless.processor.driver.metrics`), and keeps the
latest batch's figures and their totals since the endpoint started; a stdlib HTTP server
on a daemon thread serves them in Prometheus' text format at `/metrics`. No dependency:
the format is a few lines of text.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pyspark.sql import SparkSession

from shardless.processor.driver import metrics
from shardless.processor.driver.progress_listener import ProgressJsonListener
from shardless.processor.errors import ConfigError

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Each figure: (the stem of its metric names, help).
_FIGURES = {
    "records": ("records", "Kinesis user records processed"),
    "outputs": ("outputs", "outputs emitted"),
    "committed_slices": ("committed_slices", "slice commits (a slice per batch that changed)"),
    "segment_bytes": ("segment_bytes", "changelog bytes written to S3"),
    "timers_fired": ("timers_fired", "timers fired"),
    "dead_letters": ("dead_letters", "records set aside as dead letters"),
    "late_records": ("late_records", "records at or before the event-time watermark"),
    "handler_retries": ("handler_retries", "handler calls run again after raising"),
    "snapshots": ("snapshots", "slice snapshots uploaded"),
    "snapshot_bytes": ("snapshot_bytes", "snapshot bytes uploaded"),
    "restores": ("restores", "slice restores that brought state from S3"),
    "restored_bytes": ("restored_bytes", "bytes restored from S3"),
    "restore_seconds": ("restore_seconds", "seconds spent restoring slices (summed)"),
    "groups": ("group_calls", "group calls (one per group Spark ran in a batch)"),
}


def _labels(labels: dict[str, str]) -> str:
    def escape(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{escape(str(v))}"' for k, v in labels.items()) + "}"


def _number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class Exporter:
    """The figures of one query (by name), fed progress by progress, rendered as text."""

    def __init__(self, app: str, query_name: str) -> None:
        self._lock = threading.Lock()
        self.follow(app, query_name)

    def follow(self, app: str, query_name: str) -> None:
        """Start over on another query (a new job in this driver): totals from zero."""
        with self._lock:
            self.app, self.query_name = app, query_name
            self.batches = 0
            self.batch_id: int | None = None
            self.duration_s = 0.0
            self.latest: dict[str, Any] = {}
            self.totals: dict[str, float] = dict.fromkeys(_FIGURES, 0)

    def observe(self, progress: dict[str, Any]) -> bool:
        """Take one progress (its JSON as a dict); False if not this query's or not a new
        batch with shardless's figures (a trigger that ran no batch has none)."""
        found = metrics.figures(progress.get("observedMetrics") or {})
        with self._lock:
            if progress.get("name") != self.query_name or not found:
                return False
            batch_id = int(progress["batchId"])
            if self.batch_id is not None and batch_id <= self.batch_id:
                return False  # a progress seen before: counted once
            self.batch_id, self.latest = batch_id, found
            self.batches += 1
            self.duration_s = (progress.get("durationMs") or {}).get("triggerExecution", 0) / 1e3
            for name in _FIGURES:
                self.totals[name] += found[name]
            return True

    def render(self) -> str:
        """The text exposition format (version 0.0.4)."""
        with self._lock:
            base = {"app": self.app}
            lines: list[str] = []

            def metric(name: str, kind: str, help: str, values: list[tuple[dict, float]]) -> None:
                lines.append(f"# HELP {name} {help}")
                lines.append(f"# TYPE {name} {kind}")
                lines.extend(f"{name}{_labels(lb)} {_number(v)}" for lb, v in values)

            metric(
                "shardless_batches_total", "counter", "batches completed", [(base, self.batches)]
            )
            if self.batch_id is not None:
                metric("shardless_batch_id", "gauge", "the latest batch", [(base, self.batch_id)])
                metric(
                    "shardless_batch_duration_seconds", "gauge",
                    "the latest batch's time, Spark's triggerExecution", [(base, self.duration_s)],
                )  # fmt: skip
            for name, (stem, help) in _FIGURES.items():
                metric(f"shardless_{stem}_total", "counter", help, [(base, self.totals[name])])
                if self.latest:
                    value = self.latest[name]
                    metric(
                        f"shardless_batch_{stem}", "gauge", f"{help}, latest batch", [(base, value)]
                    )
            lag = []
            for key, ms in sorted(self.latest.get("millis_behind_latest", {}).items()):
                stream, _, shard = key.rpartition("/")
                lag.append(({**base, "stream": stream, "shard": shard}, ms))
            metric(
                "shardless_shard_millis_behind_latest", "gauge",
                "MillisBehindLatest of each shard that gave records in the latest batch", lag,
            )  # fmt: skip
            oldest = self.latest.get("oldest_unread_arrival_ms")
            metric(
                "shardless_oldest_unread_arrival_timestamp_seconds", "gauge",
                "arrival time of the oldest record the latest batch left unread in any shard "
                "(no sample: it left none)",
                [] if oldest is None else [(base, oldest / 1000)],
            )  # fmt: skip
            return "\n".join(lines) + "\n"


class _Listener(ProgressJsonListener):
    def __init__(self, exporter: Exporter) -> None:
        self.exporter = exporter

    def on_progress(self, progress: dict[str, Any]) -> None:
        try:
            self.exporter.observe(progress)
        except Exception:  # noqa: BLE001 - a listener that raises is dropped by Spark
            log.exception("metrics: cannot read a progress report")


class Endpoint:
    """A running endpoint: its HTTP server, its exporter, and the session it listens to."""

    def __init__(self, server: ThreadingHTTPServer, exporter: Exporter, spark: Any) -> None:
        self.server, self.exporter, self.spark = server, exporter, spark
        self.listener = _Listener(exporter)
        spark.streams.addListener(self.listener)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def stop(self) -> None:
        self.spark.streams.removeListener(self.listener)
        self.server.shutdown()
        self.server.server_close()


_endpoints: dict[tuple[str, int], Endpoint] = {}


def serve(spark: SparkSession, app: str, host: str, port: int) -> Endpoint:
    """Serve the figures of the query `shardless-<app>` at http://host:port/metrics. A
    driver that starts another job on the same address keeps one endpoint, following the
    new query."""
    query_name = f"shardless-{app}"
    found = _endpoints.get((host, port))
    if found is not None and found.spark is spark:
        found.exporter.follow(app, query_name)
        return found
    if found is not None:
        found.stop()
    exporter = Exporter(app, query_name)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404, "the figures are at /metrics")
                return
            body = exporter.render().encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("metrics: " + format, *args)

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port}: {exc}") from exc
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="shardless-metrics", daemon=True).start()
    endpoint = _endpoints[(host, port)] = Endpoint(server, exporter, spark)
    log.info("metrics: Prometheus endpoint at http://%s:%s/metrics", host, endpoint.port)
    return endpoint


def stop_all() -> None:
    """Stop every endpoint of this process (tests)."""
    while _endpoints:
        _, endpoint = _endpoints.popitem()
        endpoint.stop()
