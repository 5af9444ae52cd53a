"""Byte counters: how many bytes the ``rdma://`` comms of this process moved.

A verbs device counts packets (the soft device's ``tx_packets`` /
``rx_packets``, kernel rxe's ``sent_pkts`` / ``rcvd_pkts``); to see that a
computation's data went over RDMA a user wants bytes. The backend counts, per
device and per peer, the bytes of every Dask message it sent and received
(the frame table and every frame), how many of them were frames moved as
large messages (the receiver's RDMA Read straight into the destination, no
copy), and the messages and frames. :func:`byte_counters` returns them
with the device's own counters beside them::

    >>> from aiordma.integrations.dask import byte_counters
    >>> byte_counters()["devices"]["soft:soft0@127.0.0.2:4791"]
    {'tx_bytes': 1073741987, 'rx_bytes': 312, 'tx_messages': 3, ..., 'device': {'tx_packets': ...}}

In a cluster, ask every worker: ``client.run(byte_counters)``.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any

from ...providers.base import DeviceContext, device_label

__all__ = ["ByteCounts", "byte_counters", "counts_for", "device_label", "reset_byte_counters"]


@dataclass
class ByteCounts:
    """What the comms of one device (or toward one peer) moved."""

    tx_bytes: int = 0
    rx_bytes: int = 0
    tx_messages: int = 0
    rx_messages: int = 0
    tx_frames: int = 0
    rx_frames: int = 0
    #: bytes of frames sent / received as large messages (pulled by the receiver's RDMA Read)
    tx_large_bytes: int = 0
    rx_large_bytes: int = 0

    def add_tx(self, nbytes: int, frames: int, large: int) -> None:
        self.tx_bytes += nbytes
        self.tx_messages += 1
        self.tx_frames += frames
        self.tx_large_bytes += large

    def add_rx(self, nbytes: int, frames: int, large: int) -> None:
        self.rx_bytes += nbytes
        self.rx_messages += 1
        self.rx_frames += frames
        self.rx_large_bytes += large


_lock = threading.Lock()
_devices: dict[str, tuple[DeviceContext, ByteCounts]] = {}
_peers: dict[str, ByteCounts] = {}


def counts_for(device: DeviceContext, peer: str | None) -> tuple[ByteCounts, ByteCounts]:
    """The counts a comm on ``device`` toward ``peer`` (a Dask address) adds to.

    ``peer=None`` (a comm a listener accepted: its peer address is the client's
    temporary port, a new one per connection) counts toward the device only:
    the second count is the comm's own, kept nowhere."""
    label = device_label(device)
    with _lock:
        entry = _devices.get(label)
        if entry is None or entry[0] is not device:
            # a device closed and opened again under the same label keeps counting
            old = entry[1] if entry is not None else ByteCounts()
            entry = _devices[label] = (device, old)
        if peer is None:
            return entry[1], ByteCounts()
        peer_counts = _peers.get(peer)
        if peer_counts is None:
            peer_counts = _peers[peer] = ByteCounts()
    return entry[1], peer_counts


def _device_counters(device: DeviceContext) -> dict[str, int]:
    try:
        counters = getattr(device, "counters", None)
        return dict(counters) if counters is not None else {}
    except Exception:  # a closed device
        return {}


def byte_counters() -> dict[str, Any]:
    """A snapshot of this process's counts.

    ``{"devices": {label: {tx_bytes, rx_bytes, tx_messages, rx_messages,
    tx_frames, rx_frames, tx_large_bytes, rx_large_bytes, "device": {the
    device's own counters}}}, "peers": {Dask address: {the same counts}}}``.

    ``peers`` holds the comms this process opened, by the address it connected
    to (the peer's listener: what Dask's ``transfer_incoming_log`` calls
    ``who``); comms a listener accepted count toward their device only.
    """
    with _lock:
        devices = list(_devices.items())
        peers = {peer: asdict(c) for peer, c in _peers.items()}
    out: dict[str, Any] = {}
    for label, (device, counts) in devices:
        entry: dict[str, Any] = asdict(counts)
        entry["device"] = _device_counters(device)
        out[label] = entry
    return {"devices": out, "peers": peers}


def reset_byte_counters() -> None:
    """Start counting from zero (benchmarks, tests)."""
    with _lock:
        _devices.clear()
        _peers.clear()
