"""``aiordma doctor``'s traffic-class check: which priority the process's
traffic class reaches on the chosen device's netdev, and whether that priority
has PFC, from iproute2's ``dcb`` or NVIDIA's ``mlnx_qos`` (their outputs as the
tools print them, given to the doctor's probe: the doctor's seam for what a
machine without the NIC cannot show)."""

from __future__ import annotations

import pytest

from aiordma.tools.doctor.qos import parse_dcb, parse_mlnx_qos
from aiordma.tools.doctor.report import OK, SKIP, WARN

from .test_doctor import FakeProbe, diag, make_tree

pytestmark = pytest.mark.engine_neutral  # the same on every engine and core: CI's reference run leaves it out

DCB_PFC3 = "prio-pfc 0:off 1:off 2:off 3:on 4:off 5:off 6:off 7:off\n"
DCB_APP = "dscp-prio 0:0 8:1 16:2 24:3 26:3 46:5 48:6\n"
DCB_TRUST = "order dscp pcp\n"

MLNX_QOS = """DCBX mode: OS controlled
Priority trust state: dscp
dscp2prio mapping:
	prio:0 dscp:07,06,05,04,03,02,01,00,
	prio:1 dscp:15,14,13,12,11,10,09,08,
	prio:2 dscp:23,22,21,20,19,18,17,16,
	prio:3 dscp:31,30,29,28,27,26,25,24,
	prio:4 dscp:39,38,37,36,35,34,33,32,
	prio:5 dscp:47,46,45,44,43,42,41,40,
	prio:6 dscp:55,54,53,52,51,50,49,48,
	prio:7 dscp:63,62,61,60,59,58,57,56,
Receive buffer size (bytes): 130944,130944,0,0,0,0,0,0,
PFC configuration:
	priority    0   1   2   3   4   5   6   7
	enabled     0   0   0   1   0   0   0   0
	buffer      0   0   0   1   0   0   0   0
"""


def _dcb(argv):
    joined = " ".join(argv)
    if "apptrust" in joined:
        return 0, DCB_TRUST
    if "dscp-prio" in joined:
        return 0, DCB_APP
    if "prio-pfc" in joined:
        return 0, DCB_PFC3
    return 1, "unknown"


def test_the_tools_outputs_are_read():
    qos = parse_dcb(DCB_TRUST, DCB_APP, DCB_PFC3)
    assert (qos.trust, qos.pfc, qos.dscp_prio[26]) == ("dscp", {3}, 3)
    qos = parse_mlnx_qos(MLNX_QOS)
    assert (qos.trust, qos.pfc, qos.dscp_prio[26], qos.dscp_prio[0], len(qos.dscp_prio)) == ("dscp", {3}, 3, 0, 64)
    assert parse_dcb(None, None, None) is None and parse_mlnx_qos("no such device") is None


def test_the_default_class_on_a_pfc_fabric_warns_and_names_a_lossless_one(tmp_path):
    report = diag(FakeProbe(make_tree(tmp_path), commands={"dcb": _dcb}), provider="pyverbs")
    check = report.get("traffic class")
    assert check.status == WARN, check
    assert "DSCP 0 -> priority 0 (trust dscp)" in check.seen and "PFC on priorities: 3" in check.seen
    assert "AIORDMA_TRAFFIC_CLASS=96" in check.fix  # DSCP 24, the first of priority 3
    assert report.exit_status == 0


def test_a_class_on_the_lossless_priority_is_ok(tmp_path):
    probe = FakeProbe(make_tree(tmp_path), env={"AIORDMA_TRAFFIC_CLASS": "104"}, commands={"mlnx_qos": (0, MLNX_QOS)})
    check = diag(probe, provider="pyverbs").get("traffic class")
    assert check.status == OK, check
    assert "traffic class 104 (DSCP 26)" in check.seen and "DSCP 26 -> priority 3" in check.seen
    assert "(mlnx_qos)" in check.seen


def test_without_the_tools_it_says_what_to_check(tmp_path):
    check = diag(FakeProbe(make_tree(tmp_path)), provider="pyverbs").get("traffic class")
    assert check.status == SKIP and "neither `dcb`" in check.seen and "DSCP 0" in check.fix


def test_the_soft_device_has_no_priorities_to_check(tmp_path):
    check = diag(FakeProbe(tmp_path), provider="soft").get("traffic class")
    assert check.status == SKIP and "soft device" in check.seen
