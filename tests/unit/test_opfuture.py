"""aiordma._core.OpFuture: asyncio's future protocol, and its one difference.

An awaited operation's future must behave as an asyncio future wherever asyncio
looks at one (a Task awaiting it, ``asyncio.isfuture``, ``wait``, ``gather``,
``wait_for``, ``shield``, cancellation with a message, callbacks run in their own
context, ``InvalidStateError`` on a second resolve). The difference: resolved
outside any task — as a completion is, in the event loop's reader callback — it
resumes the task awaiting it at once (in the task's context), instead of queueing
the wake-up for the next turn of the loop; resolved inside a task, it queues it
as asyncio does. Every test runs on asyncio and uvloop.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib

import pytest


def _core():
    try:
        return importlib.import_module("aiordma._core")
    except ImportError as e:  # pragma: no cover - a broken build
        pytest.fail(f"the compiled core aiordma._core is not built ({e})")


OpFuture = _core().OpFuture
var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")


async def test_it_is_a_future_to_asyncio() -> None:
    loop = asyncio.get_running_loop()
    fut = OpFuture(loop)
    assert asyncio.isfuture(fut) and fut.get_loop() is loop and not fut.done()
    with pytest.raises(asyncio.InvalidStateError):
        fut.result()
    loop.call_soon(fut.set_result, 7)
    assert await fut == 7
    assert fut.done() and not fut.cancelled() and fut.exception() is None
    with pytest.raises(asyncio.InvalidStateError):
        fut.set_result(8)
    # gather, wait, wait_for and shield take it as they take an asyncio future
    futs = [OpFuture(loop) for _ in range(3)]
    for i, f in enumerate(futs):
        loop.call_soon(f.set_result, i)
    assert await asyncio.gather(*futs) == [0, 1, 2]
    f = OpFuture(loop)
    loop.call_later(0.01, f.set_result, "late")
    done, pending = await asyncio.wait([f], timeout=5)
    assert done == {f} and not pending
    f = OpFuture(loop)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(f, 0.01)
    assert f.cancelled()  # wait_for cancels what it waited for
    f = OpFuture(loop)
    loop.call_soon(f.set_result, "shielded")
    assert await asyncio.shield(f) == "shielded"


async def test_exceptions_and_cancellation() -> None:
    loop = asyncio.get_running_loop()
    fut = OpFuture(loop)
    loop.call_soon(fut.set_exception, ConnectionError("gone"))
    with pytest.raises(ConnectionError, match="gone"):
        await fut
    assert isinstance(fut.exception(), ConnectionError)
    fut = OpFuture(loop)
    fut.set_exception(KeyError)  # a class is instantiated, as asyncio does
    assert isinstance(fut.exception(), KeyError)
    with pytest.raises(TypeError):
        OpFuture(loop).set_exception(StopIteration())
    fut = OpFuture(loop)
    assert fut.cancel("why") and not fut.cancel()
    assert fut.cancelled() and fut.done()
    with pytest.raises(asyncio.CancelledError, match="why"):
        fut.result()
    # a task awaiting it is cancelled through it, and the future with it
    fut = OpFuture(loop)
    task = asyncio.create_task(_await(fut))
    await asyncio.sleep(0)
    task.cancel("stop")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fut.cancelled()


async def _await(fut):
    return await fut


async def test_callbacks_run_in_their_context_through_the_loop() -> None:
    loop = asyncio.get_running_loop()
    fut = OpFuture(loop)
    seen = []
    ctx = contextvars.copy_context()
    ctx.run(var.set, "theirs")
    fut.add_done_callback(lambda f: seen.append(("a", var.get(), f.result())), context=ctx)
    fut.add_done_callback(lambda f: seen.append(("b", var.get(), f.result())))
    cb = lambda f: seen.append("removed")
    fut.add_done_callback(cb)
    assert fut.remove_done_callback(cb) == 1
    fut.set_result(1)
    assert seen == []  # plain callbacks are scheduled, never run inside set_result
    await asyncio.sleep(0)
    assert seen == [("a", "theirs", 1), ("b", "unset", 1)]
    fut.add_done_callback(lambda f: seen.append("after"))  # already done: scheduled at once
    await asyncio.sleep(0)
    assert seen[-1] == "after"


async def test_a_task_resumes_at_once_when_resolved_outside_any_task() -> None:
    """resolve_now from a loop callback (no task running): the awaiting task runs its
    next step inside the call, in its own context; from a task, or set_result
    anywhere, it is queued for the next turn as asyncio does."""
    loop = asyncio.get_running_loop()
    order: list[str] = []

    async def waiter(fut):
        var.set("task")
        value = await fut
        order.append(f"resumed {value} {var.get()} {asyncio.current_task() is task}")
        return value

    fut = OpFuture(loop)
    task = asyncio.create_task(waiter(fut))
    await asyncio.sleep(0)
    done = loop.create_future()

    def resolve():
        var.set("callback")
        fut.resolve_now(1)
        order.append(f"after resolve_now {var.get()} {asyncio.current_task()}")
        done.set_result(None)

    loop.call_soon(resolve)
    await done
    assert order == ["resumed 1 task True", "after resolve_now callback None"]
    assert await task == 1

    # resolved inside a task: queued
    order.clear()
    fut = OpFuture(loop)
    task = asyncio.create_task(waiter(fut))
    await asyncio.sleep(0)
    fut.resolve_now(2)
    order.append("after resolve_now in a task")
    assert await task == 2
    assert order == ["after resolve_now in a task", "resumed 2 task True"]

    # set_result, even outside any task: queued, as asyncio does
    order.clear()
    fut = OpFuture(loop)
    task = asyncio.create_task(waiter(fut))
    await asyncio.sleep(0)
    done = loop.create_future()

    def resolve_plainly():
        fut.set_result(3)
        order.append("after set_result")
        done.set_result(None)

    loop.call_soon(resolve_plainly)
    await done
    assert await task == 3
    assert order == ["after set_result", "resumed 3 task True"]


async def test_an_exception_escaping_the_resumed_task_reaches_the_resolver() -> None:
    """KeyboardInterrupt and SystemExit escape an asyncio task's step (the task keeps
    them as its exception too): resumed at once, the task's escapes resolve_now, which
    is where the caller (the completion handler) keeps what it had not delivered."""
    loop = asyncio.get_running_loop()
    Stop = SystemExit

    async def raiser(fut):
        await fut
        raise Stop(3)

    fut = OpFuture(loop)
    task = asyncio.create_task(raiser(fut))
    await asyncio.sleep(0)
    caught = loop.create_future()

    def resolve():
        try:
            fut.resolve_now(None)
        except Stop:
            caught.set_result("escaped")

    loop.call_soon(resolve)
    assert await asyncio.wait_for(caught, 5) == "escaped"
    assert task.done()
    with pytest.raises(Stop):
        task.result()
