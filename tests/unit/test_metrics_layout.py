"""The metrics' one table (:mod:`aiordma.metrics`): kinds, the opcode table, latency
buckets, the compiled core's layout; and reading a kernel device's counters from sysfs
(:func:`aiordma.prometheus.kernel_device_counters`, over a directory laid out as
``/sys/class/infiniband`` is)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiordma import metrics
from aiordma.prometheus import kernel_device_counters
from aiordma.verbs import WROpcode

pytestmark = pytest.mark.engine_neutral


def test_every_send_queue_opcode_has_a_kind() -> None:
    assert {WROpcode(op).name: metrics.KINDS[k] for op, k in metrics.KIND_OF_OPCODE.items()} == {
        "IBV_WR_RDMA_WRITE": "write",
        "IBV_WR_RDMA_WRITE_WITH_IMM": "write",
        "IBV_WR_SEND": "send",
        "IBV_WR_SEND_WITH_IMM": "send",
        "IBV_WR_RDMA_READ": "read",
        "IBV_WR_ATOMIC_CMP_AND_SWP": "atomic",
        "IBV_WR_ATOMIC_FETCH_AND_ADD": "atomic",
    }


@pytest.mark.parametrize(
    "ns, bucket",
    [
        (0, 0),
        (1, 0),
        (1000, 0),
        (1001, 1),
        (2000, 1),
        (2001, 2),
        (4000, 2),
        (4001, 3),
        (1_048_576_000, 20),
        (1_048_576_001, 21),
        (10**12, 21),
    ],
)
def test_a_latency_falls_in_the_first_bucket_it_does_not_exceed(ns: int, bucket: int) -> None:
    assert metrics.bucket_of(ns) == bucket
    if bucket < len(metrics.BUCKET_BOUNDS_NS):
        assert ns <= metrics.BUCKET_BOUNDS_NS[bucket]
    if bucket:
        assert ns > metrics.BUCKET_BOUNDS_NS[bucket - 1]


def test_the_compiled_core_counts_in_the_same_layout() -> None:
    core = pytest.importorskip("aiordma._core", reason="the compiled core is not built")
    kinds, buckets, statuses, opcodes = core.metrics_layout()
    assert (kinds, buckets, statuses) == (len(metrics.KINDS), metrics.N_BUCKETS, metrics.N_STATUSES)
    assert opcodes == tuple(metrics.KIND_OF_OPCODE.get(op, 0) for op in range(len(opcodes)))
    with pytest.raises(ImportError, match="layout"):
        metrics.add_compiled(core.metrics_counts, (kinds, buckets + 1, statuses, opcodes), core.metrics_set_timing)


def test_a_snapshot_adds_the_two_cores_and_only_grows() -> None:
    first = metrics.snapshot()
    metrics.completed(metrics.WRITE, 2, 128, metrics.now_ns() - 3000)
    metrics.failed(metrics.READ, 10)
    metrics.received(1, 64, 1)
    second = metrics.snapshot()
    assert second["write"].operations == first["write"].operations + 1
    assert second["write"].work_requests == first["write"].work_requests + 2
    assert second["write"].bytes == first["write"].bytes + 128
    assert second["write"].timed == first["write"].timed + 1
    assert second["read"].failed[10] == first["read"].failed.get(10, 0) + 1
    assert (second["receive"].operations, second["receive"].bytes) == (
        first["receive"].operations + 1,
        first["receive"].bytes + 64,
    )


def _write(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value + "\n")


def test_kernel_device_counters_read_sysfs_as_rxe_lays_it_out(tmp_path: Path) -> None:
    port = tmp_path / "rxe0" / "ports" / "1"
    _write(port / "counters" / "port_xmit_data", "250")  # 4-byte words
    _write(port / "counters" / "port_rcv_data", "1000")
    _write(port / "counters" / "port_xmit_packets", "7")
    _write(port / "counters" / "port_rcv_packets", "9")
    _write(port / "hw_counters" / "completer_retry_err", "3")
    _write(port / "hw_counters" / "send_rnr_err", "1")
    _write(port / "hw_counters" / "rcvd_rnr_err", "2")
    _write(port / "hw_counters" / "link_downed", "0")
    _write(port / "hw_counters" / "sent_pkts", "11")  # (the port counters give packets already)
    _write(port / "hw_counters" / "broken", "not a number")
    got = {
        k: (series, tuple(sorted(labels.items())), v)
        for k, (series, labels, v) in kernel_device_counters("rxe0", 1, tmp_path).items()
    }
    assert got == {
        "port_xmit_data": ("aiordma_device_sent_bytes_total", (), 1000),
        "port_rcv_data": ("aiordma_device_received_bytes_total", (), 4000),
        "port_xmit_packets": ("aiordma_device_sent_packets_total", (), 7),
        "port_rcv_packets": ("aiordma_device_received_packets_total", (), 9),
        "hw:completer_retry_err": ("aiordma_device_retransmissions_total", (), 3),
        "hw:send_rnr_err": ("aiordma_device_rnr_naks_total", (("direction", "sent"),), 1),
        "hw:rcvd_rnr_err": ("aiordma_device_rnr_naks_total", (("direction", "received"),), 2),
        "hw:link_downed": ("aiordma_device_hw_counter_total", (("counter", "link_downed"),), 0),
        "hw:sent_pkts": ("aiordma_device_hw_counter_total", (("counter", "sent_pkts"),), 11),
    }
    assert kernel_device_counters("mlx5_0", 1, tmp_path) == {}  # absent: nothing, no error


def test_rxe_without_port_counters_counts_packets_from_its_hw_counters(tmp_path: Path) -> None:
    hw = tmp_path / "rxe0" / "ports" / "1" / "hw_counters"
    _write(hw / "sent_pkts", "5")
    _write(hw / "rcvd_pkts", "6")
    got = kernel_device_counters("rxe0", 1, tmp_path)
    assert got == {
        "hw:rcvd_pkts": ("aiordma_device_received_packets_total", {}, 6),
        "hw:sent_pkts": ("aiordma_device_sent_packets_total", {}, 5),
    }
