"""Defects found in the read-through of the layers (issue: clear seams)."""

from __future__ import annotations

import copy
import gc
import weakref

from aiordma.memory import protection_domain, register
from aiordma.providers import open_device
from aiordma.providers.base import ACCESS_ALL, MTU, QPAttr, QPCap, QPState, gid_from_ipv4


def test_a_closed_device_is_released():
    """The shared protection domain lives on the device, not in a module-global
    cache keyed by id(device) that kept every device alive."""
    dev = open_device("soft")
    pd = protection_domain(dev)
    assert protection_domain(dev) is pd  # one shared PD per device
    region = register(bytearray(4096), device=dev)
    region.close()
    ref = weakref.ref(dev)
    dev.close()
    del dev, pd, region
    gc.collect()
    assert ref() is None, "something still holds the closed device"


def test_the_callers_qp_attributes_are_not_modified():
    dev = open_device("soft")
    try:
        pd = dev.alloc_pd()
        cq = dev.create_cq(16)
        qp = pd.create_qp(cq, cq, QPCap())
        init = QPAttr(port_num=1, qp_access_flags=ACCESS_ALL)
        rtr = QPAttr(dest_qp_num=0x123, rq_psn=5, dgid=gid_from_ipv4(dev.address[0]), max_dest_rd_atomic=4)
        rts = QPAttr(sq_psn=7, timeout=14, retry_cnt=7, rnr_retry=7, max_rd_atomic=4)
        templates = [copy.deepcopy(a) for a in (init, rtr, rts)]
        qp.to_init(init)
        qp.to_rtr(rtr)
        qp.to_rts(rts)
        assert qp.state == QPState.IBV_QPS_RTS
        assert [init, rtr, rts] == templates  # no qp_state, no path_mtu written into them
        assert rtr.path_mtu is None and rtr.qp_state is None
        assert MTU.IBV_MTU_4096 == qp.query().path_mtu
        qp.close()
    finally:
        dev.close()
