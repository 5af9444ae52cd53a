"""Which source GID a connection uses, and the refusals that name a usable one
(:func:`aiordma.providers.base.choose_gid`), on GID tables laid out as kernel
rxe and mlx5 lay out a RoCE port's: link-local entries first (RoCE v1 and v2 for
the interface's fe80:: address), then one pair per IP address."""

from __future__ import annotations

import pytest

from aiordma import GIDError
from aiordma.providers.base import DeviceContext, GIDEntry, choose_gid, gid_problem, parse_gid

LINK_LOCAL = parse_gid("fe80::5054:ff:fe12:3456")
IPV4 = parse_gid("::ffff:192.168.7.2")
IPV6 = parse_gid("2001:db8::2")

RXE_PORT = [
    GIDEntry(0, LINK_LOCAL, "RoCE v1", "eth0"),
    GIDEntry(1, LINK_LOCAL, "RoCE v2", "eth0"),
    GIDEntry(2, IPV4, "RoCE v1", "eth0"),
    GIDEntry(3, IPV4, "RoCE v2", "eth0"),
]


def test_the_default_is_the_roce_v2_gid_with_an_ipv4_address():
    entry, why = choose_gid("rxe0", 1, RXE_PORT, None)
    assert entry.index == 3 and "IPv4" in why


def test_ipv6_only_ports_use_their_global_roce_v2_gid():
    table = [GIDEntry(0, LINK_LOCAL, "RoCE v1", "eth0"), GIDEntry(1, LINK_LOCAL, "RoCE v2", "eth0")]
    table += [GIDEntry(2, IPV6, "RoCE v1", "eth0"), GIDEntry(3, IPV6, "RoCE v2", "eth0")]
    entry, why = choose_gid("mlx5_0", 1, table, None)
    assert entry.index == 3 and "IPv6" in why


@pytest.mark.parametrize("index", [0, 1])
def test_a_link_local_gid_is_refused_naming_a_usable_index(index):
    with pytest.raises(GIDError) as e:
        choose_gid("rxe0", 1, RXE_PORT, index)
    message = str(e.value)
    assert f"GID index {index} of rxe0 port 1" in message and "link-local" in message
    assert "use GID index 3 (RoCE v2, 192.168.7.2 on eth0)" in message and "AIORDMA_GID_INDEX=3" in message


def test_a_gid_without_a_network_device_is_refused():
    table = [GIDEntry(0, IPV6, "RoCE v2", None), GIDEntry(1, IPV4, "RoCE v2", "eth1")]
    assert gid_problem(table[0]) == "no network device carries its address"
    with pytest.raises(
        GIDError, match=r"no network device carries its address; use GID index 1 \(RoCE v2, 192\.168\.7\.2 on eth1\)"
    ):
        choose_gid("mlx5_1", 1, table, 0)


def test_an_empty_slot_or_a_missing_index_is_refused():
    table = [GIDEntry(0, bytes(16), "RoCE v2", "eth0"), *RXE_PORT[1:]]
    with pytest.raises(GIDError, match="the slot is empty"):
        choose_gid("rxe0", 1, table, 0)
    with pytest.raises(GIDError, match="has no GID at index 9; use GID index 3"):
        choose_gid("rxe0", 1, RXE_PORT, 9)


def test_a_port_with_only_link_local_gids_says_so():
    with pytest.raises(GIDError, match="has no usable GID"):
        choose_gid("rxe0", 1, RXE_PORT[:2], None)


def test_a_usable_index_is_taken_as_asked():
    entry, why = choose_gid("rxe0", 1, RXE_PORT, 2)
    assert entry.index == 2 and why == "GID index 2, as asked"


def test_gid_error_is_a_device_error_and_a_value_error():
    import aiordma

    assert issubclass(GIDError, aiordma.DeviceNotFoundError) and issubclass(GIDError, ValueError)


class _Port(DeviceContext):
    """A device whose port 1 has ``table`` for its GID table (what the two rules read)."""

    name = "fake0"
    provider = "test"

    def __init__(self, table: list[GIDEntry]) -> None:
        self.table = table

    def query_gid_table(self, port_num: int = 1) -> list[GIDEntry]:
        return self.table

    def query_device(self):  # pragma: no cover - not used by the rules
        raise NotImplementedError

    def query_port(self, port_num: int = 1):  # pragma: no cover
        raise NotImplementedError

    def alloc_pd(self):  # pragma: no cover
        raise NotImplementedError

    def create_comp_channel(self):  # pragma: no cover
        raise NotImplementedError

    def create_cq(self, cqe, channel=None):  # pragma: no cover
        raise NotImplementedError

    def registered_memory(self):  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover
        pass


@pytest.mark.parametrize(
    "table",
    [
        RXE_PORT,
        list(reversed(RXE_PORT)),
        [GIDEntry(0, LINK_LOCAL, "RoCE v2", "eth0"), GIDEntry(5, IPV6, "RoCE v2", "eth0")],
        [GIDEntry(0, LINK_LOCAL, "RoCE v1", "eth0"), GIDEntry(1, IPV4, "RoCE v1", "eth0")],
        [GIDEntry(2, IPV6, "RoCE v1", "eth0"), GIDEntry(4, IPV4, "RoCE v2", "eth0"), GIDEntry(7, IPV6, "RoCE v2")],
        # only a link-local RoCE v2 GID: the usable RoCE v1 one comes first (not the unreachable v2)
        [GIDEntry(0, IPV4, "RoCE v1", "eth0"), GIDEntry(1, LINK_LOCAL, "RoCE v2", "eth0")],
    ],
)
def test_the_index_devices_marks_is_the_one_a_connection_uses(table):
    """``aiordma devices`` marks DeviceContext.default_gid_index; a connection
    uses choose_gid's: one preference order, so they agree on every table."""
    port = _Port(table)
    assert port.default_gid_index(1) == choose_gid("fake0", 1, table, None)[0].index == port.choose_gid(1)[0].index
