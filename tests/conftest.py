"""Shared test configuration: every async test runs on asyncio's default
loop and on uvloop (pytest-asyncio's ``pytest_asyncio_loop_factories`` hook)."""

from __future__ import annotations

import asyncio
import os

import uvloop

# tests never pick up a developer's environment by accident
for _var in (
    "AIORDMA_TOKEN",
    "AIORDMA_TOKEN_FILE",
    "AIORDMA_INSECURE",
    "AIORDMA_PROGRESS",
    "AIORDMA_SOFT_ICRC",
    "AIORDMA_SOFT_PCAP",
    "AIORDMA_PROVIDER",
):
    os.environ.pop(_var, None)


def pytest_asyncio_loop_factories(config, item):
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
