"""Many trajectories in flight, one engine: their turns gathered into the engine's batches.

Every trajectory is a coroutine (an agent); when it wants a turn it awaits ``TurnBatcher.generate``, and
when it calls a tool it awaits the tool (run off the event loop, ``tools/runner.py``). The batcher sends
the waiting turns to the engine together as soon as no trajectory can make progress without it -- each
live trajectory waits for a turn or for a tool -- or ``max_wait_s`` after the first of them arrived (an
agent that thinks for a while in Python does not hold the others back). The engine's call runs in a
thread of its own (``daemon_thread.py``: never queued behind an agent's client), so tools keep running
meanwhile, and the turns that arrive during it form the next batch.

Batches are a matter of speed only: each turn draws from its own seed and continues its own session
(``rollout/engine.py``), so which trajectories share a batch changes no token.

Over-sampling (``GroupCut``): once enough groups have every trajectory ended, no turn is started any more:
each trajectory still running ends at its next turn, which raises ``asyncio.CancelledError`` in its agent
(a turn waiting for the engine's next call too; one the engine is computing keeps its tokens), and is
carried to the next step (``carried.py``). The cut falls between turns, never inside one, so no turn is split
across two weight versions; a trajectory in a tool then ends at its next turn, or finishes. Not
``Task.cancel``: Python 3.11's ``wait_for`` drops a cancellation that meets its result (a tool's answer), and
the agent would run on. Which trajectories are cut depends on when their tools answered, not only on their
tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from gspo_megatron.rollout.agents.daemon_thread import in_daemon_thread
from gspo_megatron.rollout.engine import RolloutEngine, TurnRequest, TurnResult

T = TypeVar("T")


class GroupCut:
    """When a round has enough: ``needed`` groups (trajectories sharing ``group_of[index]``) all ended."""

    def __init__(self, group_of: list[int], needed: int):
        self.group_of, self.needed = group_of, needed
        self.running = Counter(group_of)  # trajectories not ended, per group
        self.complete = 0

    def ended(self, index: int) -> bool:
        """Trajectory ``index`` ended; whether the round has its groups now."""
        group = self.group_of[index]
        self.running[group] -= 1
        self.complete += self.running[group] == 0
        return self.complete >= self.needed


class TurnBatcher:
    def __init__(self, engine: RolloutEngine, max_wait_s: float = 0.05):
        self.engine, self.max_wait_s = engine, max_wait_s
        self._pending: list[tuple[TurnRequest, asyncio.Future[TurnResult]]] = []
        self._live = 0  # trajectories running
        self._in_tools = 0  # of them, those waiting for a tool
        self._changed: asyncio.Event | None = None
        self.batches: list[int] = []  # the size of each engine call (metrics)
        self._cut: GroupCut | None = None
        self._cut_reached = False

    async def generate(self, request: TurnRequest) -> TurnResult:
        """One turn, from whichever engine call it joins; ``asyncio.CancelledError`` once the round is cut."""
        if self._cut_reached:
            raise asyncio.CancelledError("the step has its groups: this trajectory goes on in the next step")
        future: asyncio.Future[TurnResult] = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        self._poke()
        return await future

    @contextlib.contextmanager
    def tool_call(self) -> Iterator[None]:
        """Around awaiting a tool: the trajectory waits, but not for the engine."""
        self._in_tools += 1
        self._poke()
        try:
            yield
        finally:
            self._in_tools -= 1
            self._poke()

    async def run(
        self, trajectories: list[Callable[[], Coroutine[Any, Any, T]]], cut: GroupCut | None = None
    ) -> list[T | BaseException]:
        """Run every trajectory to its end, batching their turns; each one's result or the exception that
        ended it, in order (one trajectory's failure does not stop the others). With ``cut``, the trajectories
        still running once it has its groups end with ``asyncio.CancelledError`` (module docstring)."""
        self._changed, self._cut, self._cut_reached = asyncio.Event(), cut, False
        tasks = [asyncio.create_task(self._tracked(run, index)) for index, run in enumerate(trajectories)]
        self._live = len(tasks)
        while self._live:
            await self._until_engine_is_needed()
            if self._pending:
                batch, self._pending = self._pending, []
                self.batches.append(len(batch))
                try:
                    call = functools.partial(self.engine.generate_turns, [r for r, _ in batch])
                    results = await in_daemon_thread(call, "turn-batcher-engine")
                except BaseException as error:  # noqa: BLE001 - each waiting trajectory gets it
                    for _, future in batch:
                        future.set_exception(error)
                else:
                    for (_, future), result in zip(batch, results, strict=True):
                        future.set_result(result)
        return list(await asyncio.gather(*tasks, return_exceptions=True))

    async def _tracked(self, run: Callable[[], Awaitable[T]], index: int) -> T:
        cut = False
        try:
            return await run()
        except asyncio.CancelledError:
            cut = True
            raise
        finally:
            self._live -= 1
            if not cut and self._cut is not None and self._cut.ended(index) and not self._cut_reached:
                self._stop_starting_turns()
            self._poke()

    def _stop_starting_turns(self) -> None:
        """The cut: no turn starts from now on; the turns waiting for the engine's next call end their
        trajectories (``generate`` raises for the later ones)."""
        self._cut_reached = True
        for _, future in self._pending:
            future.set_exception(asyncio.CancelledError("the step has its groups"))
        self._pending = []

    async def _until_engine_is_needed(self) -> None:
        """Until every live trajectory waits (for a turn or a tool) with a turn among them, or a turn has
        waited ``max_wait_s``, or every trajectory has ended."""
        assert self._changed is not None
        while True:
            await asyncio.sleep(0)  # runnable trajectories reach their next await first
            # checked after that await, right before clearing the event (no await between): a trajectory that
            # ended during it poked an event cleared here, and the loop waited for a poke that never came
            if not self._live or (self._pending and len(self._pending) + self._in_tools >= self._live):
                return
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), self.max_wait_s if self._pending else None)
            except TimeoutError:
                return

    def _poke(self) -> None:
        if self._changed is not None:
            self._changed.set()
