"""Blocking work awaited from the trajectories' event loop, each call in a daemon thread of its own.

    result = await in_daemon_thread(function, name="agent-client")   # function's value, or its exception

Why not ``asyncio.to_thread``: its executor has ``min(32, cores + 4)`` threads -- six on a 2-core machine --
shared by everything awaited that way. An agent's client holds its thread for the whole trajectory, so
with more trajectories than threads the engine's call queued behind clients that wait for it: the step
never ended (16 trajectories of the OpenAI endpoint agent on 2 cores; tests/unit/rollout/agents/
test_endpoint.py). And ``asyncio.run`` joins that executor's threads when it ends, so one hung call would
hang the step past every timeout; a daemon thread is not waited for. Abandoned work (its awaiter
cancelled, e.g. by a timeout) runs on until it returns, and its result is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def in_daemon_thread(function: Callable[[], T], name: str) -> T:
    """``function()`` in a new daemon thread named ``name``; its value, or the exception it raised."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[T] = loop.create_future()

    def settle(value: object, error: BaseException | None) -> None:
        if answer.done():  # the awaiter gave up on it (timeout, cancellation): dropped
            return
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(value)  # type: ignore[arg-type]

    def work() -> None:
        value: object = None
        error: BaseException | None = None
        try:
            value = function()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiter, whatever it is
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed while abandoned work ran: nobody waits
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=work, name=name, daemon=True).start()
    return await answer
