"""Integration tests: real UDP sockets, real threads, real TCP rendezvous.

Each async test fails if the event loop's exception handler was called or
if it left tasks pending (uvloop's test-suite habit).
"""

from __future__ import annotations

import asyncio

import pytest

import aiordma


@pytest.fixture(autouse=True)
async def loop_hygiene():
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    before = {t for t in asyncio.all_tasks(loop)}
    yield
    # give callbacks scheduled by close()/abort() a chance to run
    for _ in range(3):
        await asyncio.sleep(0)
    leftover = [
        t for t in asyncio.all_tasks(loop) if t not in before and t is not asyncio.current_task() and not t.done()
    ]
    for t in leftover:
        t.cancel()
    if leftover:
        await asyncio.gather(*leftover, return_exceptions=True)
    loop.set_exception_handler(None)
    assert not errors, f"event loop exception handler called: {errors[0].get('message')} {errors[0].get('exception')!r}"
    assert not leftover, f"test left tasks pending: {leftover}"


@pytest.fixture
async def echo_server():
    """An aiordma echo server on the soft device (ephemeral TCP port)."""

    async def handler(conn):
        async for msg in conn:
            await conn.send(msg)

    server = await aiordma.start_server(handler, "127.0.0.1", 0, provider="soft")
    yield server
    server.close()
    await server.wait_closed()
