"""Prometheus export: this process's aiordma series, for a registry or on their own endpoint.

Needs ``prometheus_client`` (``pip install 'aiordma[prometheus]'``). Two ways in::

    import aiordma.prometheus

    aiordma.prometheus.register()          # into prometheus_client's default REGISTRY
    server = aiordma.prometheus.serve(9464) # or: /metrics and /health on a port of their own

A service that already serves ``prometheus_client.REGISTRY`` (a Dask worker or
scheduler does: its ``/metrics``) needs only :func:`register`; the Dask backend
calls it for you when ``rdma://`` is first used.

The series are read when scraped, never kept twice: the per-operation counts
and latency histograms of :mod:`aiordma.metrics` (kept by the per-operation core
as completions are reaped), the connections of this process, and the counters
of every device it opened (the soft device's own; a kernel device's port and
``hw_counters`` from sysfs). Names, labels and units follow Prometheus's
conventions; ``docs/howto/observability.md`` has the table.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

try:
    import prometheus_client
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
    from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError(f"aiordma.prometheus needs prometheus_client ({e}): pip install 'aiordma[prometheus]'") from None

from . import __version__, metrics
from .errors import error_for_status
from .providers import open_devices
from .providers.base import DeviceContext, device_label
from .verbs import WCStatus

__all__ = ["AiordmaCollector", "MetricsServer", "collector", "register", "serve"]

#: the soft device's counters, by the series they go to: name -> (series, labels)
_SOFT_DEVICE_COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "tx_bytes": ("aiordma_device_sent_bytes_total", {}),
    "rx_bytes": ("aiordma_device_received_bytes_total", {}),
    "tx_packets": ("aiordma_device_sent_packets_total", {}),
    "rx_packets": ("aiordma_device_received_packets_total", {}),
    "rx_icrc_errors": ("aiordma_device_icrc_errors_total", {}),
    "rx_cma_bytes": ("aiordma_device_cross_memory_bytes_total", {}),
    "rx_malformed": ("aiordma_device_dropped_packets_total", {"reason": "malformed"}),
    "rx_unknown_qp": ("aiordma_device_dropped_packets_total", {"reason": "unknown_qp"}),
    "rx_wrong_source": ("aiordma_device_dropped_packets_total", {"reason": "wrong_source"}),
    "rx_errors": ("aiordma_device_dropped_packets_total", {"reason": "receive_error"}),
    "tx_dropped_full": ("aiordma_device_dropped_packets_total", {"reason": "send_buffer_full"}),
    "tx_errors": ("aiordma_device_dropped_packets_total", {"reason": "send_error"}),
}
#: the transport counters summed over every QP the soft device had (SoftDevice.transport_totals)
_SOFT_TRANSPORT_COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "retransmits": ("aiordma_device_retransmissions_total", {}),
    "timeouts": ("aiordma_device_ack_timeouts_total", {}),
    "rnr_naks_sent": ("aiordma_device_rnr_naks_total", {"direction": "sent"}),
    "rnr_naks_rcvd": ("aiordma_device_rnr_naks_total", {"direction": "received"}),
    "seq_naks_sent": ("aiordma_device_sequence_naks_total", {"direction": "sent"}),
    "seq_naks_rcvd": ("aiordma_device_sequence_naks_total", {"direction": "received"}),
    "duplicate_requests": ("aiordma_device_duplicate_requests_total", {}),
    "remote_access_errors": ("aiordma_device_remote_access_errors_total", {}),
}
#: a kernel device's port counters (sysfs ports/N/counters): the data ones count 4-byte words
_PORT_COUNTERS: dict[str, tuple[str, int]] = {
    "port_xmit_data": ("aiordma_device_sent_bytes_total", 4),
    "port_rcv_data": ("aiordma_device_received_bytes_total", 4),
    "port_xmit_packets": ("aiordma_device_sent_packets_total", 1),
    "port_rcv_packets": ("aiordma_device_received_packets_total", 1),
}
#: a kernel device's hw_counters (rxe's names; a NIC's own are passed on by name). rxe has
#: no port counters (no MAD interface): its packets are counted here, its bytes nowhere
_HW_COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "sent_pkts": ("aiordma_device_sent_packets_total", {}),
    "rcvd_pkts": ("aiordma_device_received_packets_total", {}),
    "completer_retry_err": ("aiordma_device_retransmissions_total", {}),
    "send_rnr_err": ("aiordma_device_rnr_naks_total", {"direction": "sent"}),
    "rcvd_rnr_err": ("aiordma_device_rnr_naks_total", {"direction": "received"}),
    "duplicate_request": ("aiordma_device_duplicate_requests_total", {}),
}
_SYSFS = Path("/sys/class/infiniband")

_HELP = {
    "aiordma_device_sent_bytes_total": "Bytes the device sent (RoCEv2 packets, headers included for the soft device)",
    "aiordma_device_received_bytes_total": "Bytes the device received",
    "aiordma_device_sent_packets_total": "Packets the device sent",
    "aiordma_device_received_packets_total": "Packets the device received",
    "aiordma_device_icrc_errors_total": "Received packets dropped for a wrong ICRC",
    "aiordma_device_cross_memory_bytes_total": "Bytes RDMA Reads copied from a peer process of this host "
    "(cross-memory attach) instead of the wire",
    "aiordma_device_dropped_packets_total": "Packets dropped, by reason",
    "aiordma_device_retransmissions_total": "Requests the transport sent again (no ACK in time, or a sequence NAK)",
    "aiordma_device_ack_timeouts_total": "Times the transport's ACK timer expired",
    "aiordma_device_rnr_naks_total": "Receiver-not-ready NAKs (no receive posted), sent and received",
    "aiordma_device_sequence_naks_total": "PSN sequence error NAKs, sent and received",
    "aiordma_device_duplicate_requests_total": "Requests received again (a lost ACK's retransmission)",
    "aiordma_device_remote_access_errors_total": "Requests refused by this responder's rkey, range or right checks",
    "aiordma_device_hw_counter_total": "A kernel device's other hw_counters, by name",
}


def _device_labels(device: DeviceContext) -> dict[str, str]:
    return {"device": device_label(device), "provider": str(device.provider)}


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def kernel_device_counters(name: str, port: int, sysfs: Path = _SYSFS) -> dict[str, tuple[str, dict[str, str], int]]:
    """A kernel RDMA device's counters from sysfs, as ``{key: (series, labels, value)}``:
    its port counters (bytes, packets) and its ``hw_counters`` (rxe's mapped to the
    soft device's series, the others passed on by name). A series the port counters
    give is not taken again from a hw counter."""
    out: dict[str, tuple[str, dict[str, str], int]] = {}
    base = sysfs / name / "ports" / str(port)
    for counter, (series, scale) in _PORT_COUNTERS.items():
        value = _read_int(base / "counters" / counter)
        if value is not None:
            out[counter] = (series, {}, value * scale)
    taken: set[tuple[str, tuple[tuple[str, str], ...]]] = {(series, ()) for series, _, _ in out.values()}
    hw = base / "hw_counters"
    try:
        names = sorted(p.name for p in hw.iterdir())
    except OSError:
        names = []
    for counter in names:
        value = _read_int(hw / counter)
        if value is None:
            continue
        series, labels = _HW_COUNTERS.get(counter, ("aiordma_device_hw_counter_total", {"counter": counter}))
        key = (series, tuple(sorted(labels.items())))
        if key in taken:
            series, labels = "aiordma_device_hw_counter_total", {"counter": counter}
            key = (series, tuple(sorted(labels.items())))
        taken.add(key)
        out["hw:" + counter] = (series, labels, value)
    return out


class _Families:
    """Metric families by name, made on first use (one per name, with its label names)."""

    def __init__(self) -> None:
        self.by_name: dict[str, Metric] = {}

    def counter(self, name: str, help_: str, labels: dict[str, str], value: float) -> None:
        family = self.by_name.get(name)
        if family is None:
            family = self.by_name[name] = CounterMetricFamily(name.removesuffix("_total"), help_, labels=sorted(labels))
        assert isinstance(family, CounterMetricFamily)
        family.add_metric([labels[k] for k in sorted(labels)], value)

    def gauge(self, name: str, help_: str, labels: dict[str, str], value: float) -> None:
        family = self.by_name.get(name)
        if family is None:
            family = self.by_name[name] = GaugeMetricFamily(name, help_, labels=sorted(labels))
        assert isinstance(family, GaugeMetricFamily)
        family.add_metric([labels[k] for k in sorted(labels)], value)


class AiordmaCollector(Collector):
    """A ``prometheus_client`` collector of this process's aiordma series (read when scraped)."""

    def describe(self) -> list[Metric]:
        # (nothing up front: the series are known when collected; registering
        # does not run a collection)
        return []

    def collect(self) -> Iterator[Metric]:
        families = _Families()
        yield from self._operations()
        self._connections(families)
        self._devices(families)
        self._dask(families)
        yield from families.by_name.values()

    # ------------------------------------------------------- operations ----
    @staticmethod
    def _operations() -> Iterator[Metric]:
        counts = metrics.snapshot()
        ops = CounterMetricFamily(
            "aiordma_operations",
            "Operations completed successfully, by kind (a batch counts once; receive: messages delivered)",
            labels=["op"],
        )
        wrs = CounterMetricFamily(
            "aiordma_work_requests",
            "Work requests completed successfully, by kind (receive: message chunks)",
            labels=["op"],
        )
        moved = CounterMetricFamily(
            "aiordma_operation_bytes", "Bytes moved by successful operations, by kind", labels=["op"]
        )
        errors = CounterMetricFamily(
            "aiordma_work_request_errors",
            "Work requests completed with an error status, by kind, status and the error raised",
            labels=["op", "status", "error"],
        )
        latency = HistogramMetricFamily(
            "aiordma_operation_duration_seconds",
            "Time from posting an operation to its successful completion, by kind",
            labels=["op"],
        )
        for kind, c in counts.items():
            ops.add_metric([kind], c.operations)
            wrs.add_metric([kind], c.work_requests)
            moved.add_metric([kind], c.bytes)
            for status, n in sorted(c.failed.items()):
                try:
                    name = WCStatus(status).name
                except ValueError:
                    name = str(status)
                errors.add_metric([kind, name, error_for_status(status).__name__], n)
            if kind == "receive":
                continue
            cumulative, buckets = 0, []
            for bound, n in zip(metrics.BUCKET_BOUNDS_SECONDS, c.buckets):
                cumulative += n
                buckets.append((repr(bound), cumulative))
            buckets.append(("+Inf", c.timed))
            latency.add_metric([kind], buckets, sum_value=c.latency_sum_ns / 1e9)
        yield from (ops, wrs, moved, errors, latency)

    # ------------------------------------------------------ connections ----
    @staticmethod
    def _connections(families: _Families) -> None:
        from .connection import open_connections
        from .events import ConnectionState
        from .window import PROCESS_RECV_BUDGET

        states = dict.fromkeys((s.value for s in ConnectionState), 0)
        for conn in open_connections():
            states[conn.state.value] += 1
        for state, n in states.items():
            families.gauge("aiordma_connections", "Connections not torn down yet, by state", {"state": state}, n)
        families.counter(
            "aiordma_connections_opened_total",
            "Connections made (each end counts its own)",
            {},
            metrics.connections_opened,
        )
        for error, n in sorted(dict(metrics.connections_ended).items()):
            families.counter(
                "aiordma_connections_ended_total",
                "Connections ended, by the error later operations get (ConnectionClosedError: a clean close)",
                {"error": error},
                n,
            )
        families.gauge(
            "aiordma_receive_buffered_bytes",
            "Bytes of received messages queued for the application, all connections (the process receive budget in use)",
            {},
            PROCESS_RECV_BUDGET.buffered,
        )
        families.gauge(
            "aiordma_receive_budget_bytes",
            "The process-wide receive budget: past it, receivers hold their credits back",
            {},
            PROCESS_RECV_BUDGET.limit,
        )
        families.gauge(
            "aiordma_info",
            "aiordma's version and per-operation core (always 1)",
            {"version": __version__, "latency_timing": "on" if metrics.latency_timing() else "off"},
            1,
        )

    # ---------------------------------------------------------- devices ----
    @staticmethod
    def _devices(families: _Families) -> None:
        for device in open_devices():
            labels = _device_labels(device)
            try:
                registered = device.registered_memory()
            except Exception:  # closed under us
                continue
            families.gauge(
                "aiordma_registered_memory_bytes",
                "Bytes of memory registered with the device (live memory regions)",
                labels,
                registered["bytes"],
            )
            families.gauge("aiordma_memory_regions", "Live memory regions of the device", labels, registered["regions"])
            if device.provider == "soft":
                AiordmaCollector._soft_device(families, device, labels)
            else:
                name = str(getattr(device, "name", ""))
                port = int(getattr(device, "port_num", 1))
                for series, extra, value in kernel_device_counters(name, port).values():
                    families.counter(series, _HELP[series], {**labels, **extra}, value)

    @staticmethod
    def _soft_device(families: _Families, device: Any, labels: dict[str, str]) -> None:
        try:
            counters = device.counters
            transport = device.transport_totals
        except Exception:  # closed under us
            return
        seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        for table, values in ((_SOFT_DEVICE_COUNTERS, counters), (_SOFT_TRANSPORT_COUNTERS, transport)):
            for counter, (series, extra) in table.items():
                key_labels = {**labels, **extra}
                key = (series, tuple(sorted(key_labels.items())))
                if key in seen:
                    continue
                seen.add(key)
                families.counter(series, _HELP[series], key_labels, values.get(counter, 0))

    # ------------------------------------------------------------- dask ----
    @staticmethod
    def _dask(families: _Families) -> None:
        import sys

        counters = sys.modules.get("aiordma.integrations.dask.counters")
        if counters is None:  # (the Dask backend is not in use: nothing to say)
            return
        snapshot = counters.byte_counters()
        series = {
            "tx_bytes": ("aiordma_dask_sent_bytes_total", "Bytes of Dask messages the rdma:// comms sent"),
            "rx_bytes": ("aiordma_dask_received_bytes_total", "Bytes of Dask messages the rdma:// comms received"),
            "tx_messages": ("aiordma_dask_sent_messages_total", "Dask messages the rdma:// comms sent"),
            "rx_messages": ("aiordma_dask_received_messages_total", "Dask messages the rdma:// comms received"),
            "tx_large_bytes": (
                "aiordma_dask_sent_large_bytes_total",
                "Bytes of frames sent as large messages (the receiver RDMA-Reads them, no copy)",
            ),
            "rx_large_bytes": (
                "aiordma_dask_received_large_bytes_total",
                "Bytes of frames received as large messages (RDMA-Read into place)",
            ),
        }
        for label, entry in snapshot["devices"].items():
            for key, (name, help_) in series.items():
                families.counter(name, help_, {"device": label}, entry.get(key, 0))


# ------------------------------------------------------------ registering ----

_collectors: weakref.WeakKeyDictionary[CollectorRegistry, AiordmaCollector] = weakref.WeakKeyDictionary()
_register_lock = threading.Lock()


def register(registry: CollectorRegistry | None = None) -> AiordmaCollector:
    """Add aiordma's collector to ``registry`` (default: ``prometheus_client.REGISTRY``),
    once: a second call returns the collector registered before."""
    registry = REGISTRY if registry is None else registry
    with _register_lock:
        found = _collectors.get(registry)
        if found is None:
            found = _collectors[registry] = AiordmaCollector()
            registry.register(found)
        return found


def collector(registry: CollectorRegistry | None = None) -> AiordmaCollector | None:
    """The collector :func:`register` added to ``registry``, or None."""
    return _collectors.get(REGISTRY if registry is None else registry)


class MetricsServer:
    """``/metrics`` (Prometheus's text format) and ``/health`` (JSON; HTTP 200 when
    healthy, 503 when not) on a port of their own, served by a thread."""

    def __init__(self, httpd: ThreadingHTTPServer, thread: threading.Thread) -> None:
        self._httpd = httpd
        self._thread = thread

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) it listens on."""
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    @property
    def port(self) -> int:
        return self.address[1]

    def close(self) -> None:
        """Stop serving (the port is free when this returns)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(port: int = 9464, host: str = "127.0.0.1", registry: CollectorRegistry | None = None) -> MetricsServer:
    """Serve ``/metrics`` and ``/health`` on ``host:port`` from a thread (port 0: any free one).

    ``registry`` (default: a registry of its own with aiordma's collector and
    ``prometheus_client``'s process and platform collectors) is what ``/metrics``
    shows; ``/health`` is :func:`aiordma.health.check`'s report. Loopback by
    default: the series name peers and devices, so listen wider on purpose."""
    if registry is None:
        registry = CollectorRegistry()
        prometheus_client.ProcessCollector(registry=registry)
        prometheus_client.PlatformCollector(registry=registry)
    register(registry)
    chosen = registry

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/metrics", "/"):
                body = prometheus_client.generate_latest(chosen)
                self._reply(200, prometheus_client.CONTENT_TYPE_LATEST, body)
            elif path == "/health":
                from . import health

                report = health.check()
                body = json.dumps(report.as_dict(), indent=1).encode()
                self._reply(200 if report.healthy else 503, "application/json", body)
            else:
                self._reply(404, "text/plain; charset=utf-8", b"not found: try /metrics or /health\n")

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # (no line per scrape on stderr)
            pass

    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, name=f"aiordma-metrics-{port}", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread)
