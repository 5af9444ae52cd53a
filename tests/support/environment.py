"""Which ``AIORDMA_*`` environment variables the tests may see.

aiordma reads its settings from ``AIORDMA_*`` variables (provider, device,
soft-device address, progress mode, token, ...). A developer's shell that sets
one would silently change what the tests exercise, so the root conftest
removes every ``AIORDMA_*`` variable before anything is imported, except the
few that configure the test suite itself, listed here.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: ``AIORDMA_*`` variables read by the tests (never by aiordma): kept
TEST_SUITE_VARIABLES = frozenset(
    {
        "AIORDMA_CANCEL_OPS",  # tests/integration/test_cancellation.py: operations per storm
        "AIORDMA_FUZZ_EXAMPLES",  # tests/unit/test_fuzz_receive.py: hypothesis examples
        "AIORDMA_FUZZ_WORLDS",  # tests/unit/test_fuzz_receive.py: the slow campaign's scenarios
        "AIORDMA_FUZZ_FIRST",  # the same: the first scenario run (replays a failing one)
        "AIORDMA_UDP_FUZZ_EXAMPLES",  # tests/integration/test_fuzz_receive_udp.py: hypothesis examples
        "AIORDMA_LEAK_REPS",  # tests/integration/test_leaks.py: repetitions
        "AIORDMA_LOAD_MSGS",  # tests/integration/test_load.py: messages per connection
        "AIORDMA_LOAD_MSGS_SLOW",  # the same, slow variant
        "AIORDMA_SOAK_SECONDS",  # tests/integration/test_soak.py
        "AIORDMA_STALL_S",  # tests/integration/test_stalled_receiver.py: how long the receiver stops reading
        "AIORDMA_MANY_CONNECTIONS",  # tests/rxe/test_many_connections_rxe.py: connections open at once
        "AIORDMA_CHURN_CYCLES",  # the same: connect/round trip/close rounds
        "AIORDMA_CHURN",  # the same: connections per round
        "AIORDMA_C_DEMO",  # tests/rxe: another C program for the interop tests (default tests/rxe/c/rdma_write_demo.c)
    }
)

#: aiordma settings that choose what a whole test run exercises, on purpose: CI runs
#: the suite once per soft-device engine (``AIORDMA_SOFT_ENGINE=python|native``), the
#: reference run with the interpreted per-operation core too (``AIORDMA_CORE=python``)
SUITE_SELECTORS = frozenset({"AIORDMA_SOFT_ENGINE", "AIORDMA_CORE"})

#: prefixes of kept variables: scripts/rxe-vm describes the VM's kernel rxe device to
#: tests/rxe with AIORDMA_RXE, AIORDMA_RXE_DEVICE, AIORDMA_RXE_GID_INDEX, AIORDMA_RXE_IP, ...
TEST_SUITE_PREFIXES = ("AIORDMA_RXE",)


def is_test_suite_variable(name: str) -> bool:
    """True for the ``AIORDMA_*`` variables that configure the test suite."""
    return name in TEST_SUITE_VARIABLES or name.startswith(TEST_SUITE_PREFIXES)


def clear_aiordma_environment(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Remove every ``AIORDMA_*`` variable except the test suite's own and the
    selectors of a whole run (:data:`SUITE_SELECTORS`); return what was removed."""
    names = [
        n for n in environ if n.startswith("AIORDMA_") and not is_test_suite_variable(n) and n not in SUITE_SELECTORS
    ]
    return {n: environ.pop(n) for n in names}
