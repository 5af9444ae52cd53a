"""A one-sided key-value store: the table lives in the server's registered memory,
and clients do all the work with RDMA. The server runs no code per operation.

Used by ``kv_server.py`` (which only registers and exposes the memory),
``kv_client.py`` (a command-line client) and ``benchmarks/kv.py``.

Memory the server exposes (three regions, found by name in the rendezvous):

``kv.meta`` (remote read)
    the layout: magic ``AIORDKV1``, format version, bucket count, key and
    value slot sizes, counter count (little-endian u32s after the magic).
``kv.table`` (remote read, write, atomic)
    ``buckets`` slots of ``slot_size`` bytes, open addressing with linear
    probing from ``crc32(key) % buckets``. A slot::

        0   version   u64   even: stable; odd: a writer holds the slot's lock
        8   key_len   u16   0: the slot was never used
        10  value_len u16
        12  crc       u32   CRC-32 of (version, key_len, value_len, key, value)
        16  key       key_max bytes
        ..  value     value_max bytes

``kv.counters`` (remote read, atomic)
    ``counters`` 8-byte words for fetch-and-add.

The operations, each a few one-sided verbs:

GET
    RDMA Read of the slot. Its version must be even and its CRC must match
    (a read that raced a writer fails the CRC: the writer's CRC covers the
    version it will publish): the self-verifying read of Pilaf (USENIX ATC
    2013). Otherwise read again. An unused slot ends the probe: not found.
PUT
    RDMA Read the slot; if it is free or holds the key, lock it with a
    compare-and-swap of its version ``v`` to ``v + 1`` (it fails if anything
    changed since the read), RDMA Write the entry with the CRC for version
    ``v + 2``, then fetch-and-add 1 to the version to unlock (``v + 2``):
    4 one-sided operations in 3 round trips. The Write and the unlock go
    out together: an RC queue pair executes its requests in order, so the
    peer applies the entry before the unlock, and the client waits once.
INCR
    one fetch-and-add on a counter word.

Limits of this example: no deletion, and a client that dies while holding a
slot's lock leaves that slot locked (readers and writers of that key give
up with :class:`SlotBusyError`); a real store would add leases.

Run as a program, it prints the memory a table of the given shape takes
(``kv_server.py`` takes the same options)::

    python examples/kv_store.py --buckets 65536 --value-size 1024
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import aiordma

MAGIC = b"AIORDKV1"
FORMAT_VERSION = 1
META = struct.Struct("<8sIIIII")  # magic, format version, buckets, key_max, value_max, counters
HEAD = struct.Struct("<QHHI")  # version, key_len, value_len, crc
HEAD_SIZE = 16
VERSION = struct.Struct("<Q")
MASK64 = (1 << 64) - 1
#: a slot seen locked or changing for this long (s): its writer is gone or stuck
BUSY_TIMEOUT = 2.0

META_NAME, TABLE_NAME, COUNTERS_NAME = "kv.meta", "kv.table", "kv.counters"


class KVError(Exception):
    """A key-value store operation could not be done."""


class TableFullError(KVError):
    """Every bucket is taken by another key (the server's ``--buckets`` is too small)."""


class SlotBusyError(KVError, TimeoutError):
    """A slot stayed locked (or changing) through every retry: its writer died or is stuck."""


class KVProtocolError(KVError):
    """The server's exposed memory is not a table of this format."""


@dataclass(frozen=True)
class Layout:
    """How the table is laid out in the server's memory (published in ``kv.meta``)."""

    buckets: int
    key_max: int
    value_max: int
    counters: int

    def __post_init__(self) -> None:
        if not 1 <= self.buckets <= 1 << 24:
            raise ValueError(f"buckets must be between 1 and {1 << 24}, not {self.buckets}")
        if not 1 <= self.key_max <= 0xFFFF or not 0 <= self.value_max <= 0xFFFF:
            raise ValueError("key and value slots must be 1..65535 and 0..65535 bytes")
        if not 0 <= self.counters <= 1 << 24:
            raise ValueError(f"counters must be between 0 and {1 << 24}")

    @property
    def slot_size(self) -> int:
        """Bytes per slot, a multiple of 8 (the version word of every slot is 8-byte aligned for atomics)."""
        return (HEAD_SIZE + self.key_max + self.value_max + 7) & ~7

    @property
    def table_bytes(self) -> int:
        return self.buckets * self.slot_size

    @property
    def counters_bytes(self) -> int:
        return max(8, 8 * self.counters)

    def pack(self) -> bytes:
        return META.pack(MAGIC, FORMAT_VERSION, self.buckets, self.key_max, self.value_max, self.counters)

    @classmethod
    def unpack(cls, data: bytes) -> Layout:
        if len(data) < META.size:
            raise KVProtocolError(f"kv.meta holds {len(data)} bytes, a layout needs {META.size}")
        magic, version, buckets, key_max, value_max, counters = META.unpack_from(data)
        if magic != MAGIC:
            raise KVProtocolError(f"kv.meta does not start with {MAGIC!r} (found {magic!r}): not a kv_server")
        if version != FORMAT_VERSION:
            raise KVProtocolError(
                f"the server's table format is version {version}; this client speaks {FORMAT_VERSION}"
            )
        try:
            return cls(buckets, key_max, value_max, counters)
        except ValueError as e:
            raise KVProtocolError(f"kv.meta describes an impossible table: {e}") from None

    def bucket(self, key: bytes) -> int:
        return zlib.crc32(key) % self.buckets

    def check_key(self, key: bytes) -> None:
        if not key:
            raise ValueError("keys must not be empty (an empty key marks an unused slot)")
        if len(key) > self.key_max:
            raise ValueError(f"a key of {len(key)} bytes does not fit the table's {self.key_max}-byte key slots")

    def check_counter(self, index: int) -> None:
        if not 0 <= index < self.counters:
            raise IndexError(
                f"counter {index} does not exist: the server exposes {self.counters} counters "
                "(8-byte words for fetch-and-add), numbered from 0"
            )


def entry_crc(version: int, key: bytes, value: bytes) -> int:
    """The CRC a slot holding ``key``/``value`` at ``version`` carries."""
    return zlib.crc32(value, zlib.crc32(key, zlib.crc32(struct.pack("<QHH", version, len(key), len(value)))))


def parse_slot(layout: Layout, data: Any) -> tuple[int, bytes, bytes] | None:
    """``(version, key, value)`` of a slot image, ``(version, b"", b"")`` for an
    unused one, or None if it is locked or torn (read it again)."""
    version, klen, vlen, crc = HEAD.unpack_from(data)
    if version & 1:
        return None
    if klen == 0:
        return (version, b"", b"") if vlen == 0 and crc == 0 else None
    if klen > layout.key_max or vlen > layout.value_max:
        return None
    key = bytes(data[HEAD_SIZE : HEAD_SIZE + klen])
    off = HEAD_SIZE + layout.key_max
    value = bytes(data[off : off + vlen])
    if entry_crc(version, key, value) != crc:
        return None
    return version, key, value


@dataclass
class KVStats:
    """What a client did: KV operations and the one-sided verbs they took."""

    gets: int = 0
    puts: int = 0
    incrs: int = 0
    rdma_reads: int = 0
    rdma_writes: int = 0
    compare_and_swaps: int = 0
    fetch_and_adds: int = 0
    retries: int = 0  # slot reads repeated because the slot was locked or torn
    lock_conflicts: int = 0  # compare-and-swaps that lost to another writer

    @property
    def kv_ops(self) -> int:
        return self.gets + self.puts + self.incrs

    @property
    def one_sided_ops(self) -> int:
        return self.rdma_reads + self.rdma_writes + self.compare_and_swaps + self.fetch_and_adds

    def add(self, other: KVStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class KVClient:
    """A client of a ``kv_server``: every operation is one-sided RDMA on its memory."""

    conn: aiordma.Connection
    layout: Layout
    stats: KVStats = field(default_factory=KVStats)

    def __post_init__(self) -> None:
        self.table = self.conn.remote(TABLE_NAME)
        self.counters = self.conn.remote(COUNTERS_NAME)
        if self.table.length < self.layout.table_bytes or self.counters.length < 8 * self.layout.counters:
            raise KVProtocolError("the exposed table or counters are smaller than kv.meta says")
        if self.table.addr % 8 or self.counters.addr % 8:
            raise KVProtocolError("the server's table is not 8-byte aligned: its atomics would be refused")
        size = self.layout.slot_size
        self._local = self.conn.register(bytearray(2 * size))
        self._slot_in = self._local[0:size]  # RDMA Read lands here
        self._slot_out = self._local[size : 2 * size]  # the entry is built here
        self._entry_out = self._local[size + 8 : 2 * size]  # and sent from here (all but the version word)
        # looked up once: every operation reads or builds a slot through them
        self._slot_in_view, self._slot_out_view = self._slot_in.view, self._slot_out.view
        self._slot_size = size

    @classmethod
    async def connect(cls, host: str, port: int, **options: Any) -> KVClient:
        """Connect to a kv_server (options go to :func:`aiordma.connect`) and read its layout."""
        conn = await aiordma.connect(host, port, **options)
        try:
            for name in (META_NAME, TABLE_NAME, COUNTERS_NAME):
                conn.remote(name)  # RemoteBufferNotFoundError names what the server lacks
            meta = await conn.read(conn.remote(META_NAME))
            assert meta is not None
            return cls(conn, Layout.unpack(meta))
        except BaseException:
            await conn.close()
            raise

    async def close(self) -> None:
        await self.conn.close()

    async def __aenter__(self) -> KVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _backoff(self, attempt: int, since: float) -> None:
        """Wait before retrying a slot that was locked, torn or changed (``attempt`` >= 1)."""
        self.stats.retries += 1
        loop = asyncio.get_running_loop()
        if loop.time() - since > BUSY_TIMEOUT:
            raise SlotBusyError(
                f"a slot stayed locked for {BUSY_TIMEOUT:g} s ({attempt} tries): the client holding its lock "
                "died or is stuck"
            )
        await asyncio.sleep(0 if attempt < 8 else min(0.005, 1e-4 * (attempt - 7)))

    async def _read_slot(self, index: int) -> tuple[int, bytes, bytes]:
        """A consistent image of slot ``index`` (RDMA Read until it verifies)."""
        size = self._slot_size
        remote = self.table.at(index * size, size)
        view = self._slot_in_view
        attempt = 0
        since = 0.0
        while True:
            await self.conn.read(remote, into=self._slot_in)
            self.stats.rdma_reads += 1
            slot = parse_slot(self.layout, view)
            if slot is not None:
                return slot
            if not attempt:
                since = asyncio.get_running_loop().time()
            attempt += 1
            await self._backoff(attempt, since)

    async def get(self, key: bytes) -> bytes | None:
        """The value stored under ``key``, or None."""
        self.layout.check_key(key)
        self.stats.gets += 1
        index = self.layout.bucket(key)
        for _ in range(self.layout.buckets):
            _version, k, value = await self._read_slot(index)
            if not k:
                return None
            if k == key:
                return value
            index = (index + 1) % self.layout.buckets
        return None

    async def put(self, key: bytes, value: bytes) -> None:
        """Store ``value`` under ``key`` (a CAS-locked RDMA Write of its slot)."""
        layout = self.layout
        layout.check_key(key)
        if len(value) > layout.value_max:
            raise ValueError(f"a value of {len(value)} bytes does not fit the table's {layout.value_max}-byte slots")
        self.stats.puts += 1
        size = self._slot_size
        index = layout.bucket(key)
        probes = attempt = 0
        since = 0.0
        while probes < layout.buckets:
            version, k, _ = await self._read_slot(index)
            if k and k != key:  # another key's slot: probe on
                index = (index + 1) % layout.buckets
                probes += 1
                continue
            word = self.table.at(index * size, 8)
            old = await self.conn.compare_and_swap(word, version, version + 1)
            self.stats.compare_and_swaps += 1
            if old != version:  # someone wrote or locked it since the read: look again
                self.stats.lock_conflicts += 1
                if not attempt:
                    since = asyncio.get_running_loop().time()
                attempt += 1
                await self._backoff(attempt, since)
                continue
            out = self._slot_out_view
            # the CRC covers the version the unlock publishes: a reader that sees the new entry
            # under the old version (or a mix of old and new bytes) finds it does not verify
            HEAD.pack_into(out, 0, version + 2, len(key), len(value), entry_crc(version + 2, key, value))
            out[HEAD_SIZE : HEAD_SIZE + len(key)] = key
            off = HEAD_SIZE + layout.key_max
            out[off : off + len(value)] = value
            # the entry (not the version word, which the lock owns), then unlock: v + 1 -> v + 2,
            # posted back to back (the queue pair applies them in order; one wait for both)
            written = await self.conn.post_write(self._entry_out, self.table.at(index * size + 8, size - 8))
            self.stats.rdma_writes += 1
            try:
                await self.conn.fetch_and_add(word, 1)
            finally:
                # done by now (it was ahead of the unlock); if it failed, the unlock was flushed
                # behind it and this raises the Write's own error
                await written
            self.stats.fetch_and_adds += 1
            return
        raise TableFullError(f"all {layout.buckets} buckets hold other keys: start the server with more --buckets")

    async def incr(self, index: int, delta: int = 1) -> int:
        """Add ``delta`` to counter ``index`` (one fetch-and-add); its new value (mod 2**64)."""
        self.layout.check_counter(index)
        self.stats.incrs += 1
        old = await self.conn.fetch_and_add(self.counters.at(8 * index, 8), delta & MASK64)
        self.stats.fetch_and_adds += 1
        return (old + delta) & MASK64

    async def counter(self, index: int) -> int:
        """The value of counter ``index`` (one RDMA Read)."""
        self.layout.check_counter(index)
        data = await self.conn.read(self.counters.at(8 * index, 8))
        self.stats.rdma_reads += 1
        assert data is not None
        return int(VERSION.unpack(data)[0])


# ---------------------------------------------------------------- the CLI ----


def _count(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="The one-sided key-value store's table format: print the memory a table of this shape "
        "takes (kv_server.py serves it, kv_client.py and benchmarks/kv.py use it).",
    )
    # the defaults are kv_server.py's
    p.add_argument("--buckets", type=_count, default=4096, help="hash-table slots (default 4096)")
    p.add_argument("--key-size", type=_count, default=32, help="largest key in bytes (default 32)")
    p.add_argument("--value-size", type=_count, default=64, help="largest value in bytes (default 64)")
    p.add_argument("--counters", type=_count, default=64, help="fetch-and-add counters (default 64)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        layout = Layout(args.buckets, args.key_size, args.value_size, args.counters)
    except ValueError as e:
        parser.error(str(e))
    total = META.size + layout.table_bytes + layout.counters_bytes
    print(f"{META_NAME:<12} {META.size:>12,} bytes  (remote read): magic, version and this shape")
    print(
        f"{TABLE_NAME:<12} {layout.table_bytes:>12,} bytes  (remote read, write, atomic): "
        f"{layout.buckets:,} slots of {layout.slot_size} bytes ({HEAD_SIZE}-byte head, "
        f"{layout.key_max}-byte key, {layout.value_max}-byte value)"
    )
    print(
        f"{COUNTERS_NAME:<12} {layout.counters_bytes:>12,} bytes  (remote read, atomic): "
        f"{layout.counters:,} counters of 8 bytes"
    )
    print(f"{'total':<12} {total:>12,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
