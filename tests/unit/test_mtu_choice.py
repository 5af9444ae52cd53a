"""The path-MTU rule, sans-IO (:class:`aiordma.path.MTUChoice`): what each end
announces at the rendezvous and what two announcements make, the same on both
ends whichever is the client."""

from __future__ import annotations

import itertools

from aiordma.path import ROCE_MTUS, MTUChoice, roce_mtu_at_most


def meet(a: MTUChoice, b: MTUChoice) -> tuple[tuple[int, int | None], tuple[int, int | None]]:
    here = a.negotiate(b.announced, b.announced_soft)[:2]
    there = b.negotiate(a.announced, a.announced_soft)[:2]
    return here, there


def test_roce_mtus_round_down_to_one_roce_defines():
    assert [roce_mtu_at_most(n) for n in (100, 256, 1000, 1024, 4095, 4096, 9000)] == [
        256,
        256,
        512,
        1024,
        2048,
        4096,
        4096,
    ]


def test_two_ports_meet_at_the_smaller_active_mtu_and_say_so():
    mtu, jumbo, why = MTUChoice(4096).negotiate(1024, 0)
    assert (mtu, jumbo) == (1024, None)
    assert why == "the smaller of the two ends' MTUs (4096 here, 1024 at the peer)"


def test_a_cap_is_announced_rounded_to_a_roce_mtu_and_named_as_the_reason():
    capped = MTUChoice(4096, cap=3000)
    assert capped.announced == 2048
    mtu, jumbo, why = capped.negotiate(4096, 0)
    assert (mtu, jumbo) == (2048, None) and "the cap path_mtu=3000" in why


def test_two_soft_devices_go_past_roce_and_say_why():
    a, b = MTUChoice(4096, soft_limit=16384), MTUChoice(4096, soft_limit=8192)
    assert (a.announced, a.announced_soft) == (4096, 16384)
    (mtu, jumbo), other = meet(a, b)
    assert (mtu, jumbo) == other == (4096, 8192)
    assert "two soft devices" in a.negotiate(b.announced, b.announced_soft)[2]
    # a soft device toward a real port (which announces no soft limit) stays within RoCE
    assert a.negotiate(1024, 0)[:2] == (1024, None)
    # a cap holds on the soft limit too, and is named
    capped = MTUChoice(4096, cap=6000, soft_limit=16384)
    assert capped.announced_soft == 6000
    assert "the limit here is the cap path_mtu=6000" in capped.negotiate(4096, 16384)[2]


def test_both_ends_always_agree():
    ends = [
        MTUChoice(port, cap, soft) for port in ROCE_MTUS[2:] for cap in (None, 512, 3000, 9000) for soft in (0, 8192)
    ]
    for a, b in itertools.combinations(ends, 2):
        here, there = meet(a, b)
        assert here == there, (a, b)
        mtu, jumbo = here
        assert mtu in ROCE_MTUS and mtu <= min(a.port_mtu, b.port_mtu), (a, b)
        for end in (a, b):
            if end.cap is not None:
                assert (jumbo or mtu) <= max(end.cap, 256), (a, b)
        if jumbo is not None:
            assert a.soft_limit and b.soft_limit and jumbo > mtu, (a, b)
