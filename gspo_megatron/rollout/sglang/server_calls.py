"""Control calls to SGLang servers from synchronous code: one async client on its own loop thread.

Used by the engine (generation, weight-update sessions) and by every weight sender
(``group_sender.py``: the driver's, and each pipeline stage's on its own rank).

Design decisions:
- The async client lives on an event loop run in a daemon thread; ``run`` blocks the caller until a
  coroutine ends, ``submit`` returns a ``concurrent.futures.Future`` (a sender waits on the servers'
  HTTP answers and its broadcast together).
- ``all``: the call on every server still alive. A server that dies under it (its connection lost: the
  pool marks it dead) is dropped with a warning -- it serves no later sample, so no sample comes from a
  version it missed; any other failure (a refusal, a live server's error) is raised; with no server
  left, ``NoServersLeftError``. ``best_effort`` (clean-up) warns instead of raising.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Coroutine
from typing import Any, TypeVar

from gspo_megatron.rollout.sglang.auth import ApiKey
from gspo_megatron.rollout.sglang.client import NoServersLeftError, RetryPolicy, ServerState, SGLangHTTPClient
from gspo_megatron.rollout.sglang.config import SGLangConfig

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop running in a daemon thread; ``run`` blocks the caller until a coroutine ends."""

    def __init__(self):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-client-loop", daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.submit(coroutine).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


async def gather(coroutines: list[Coroutine]) -> list[Any]:
    return list(await asyncio.gather(*coroutines))


def retry_policy(config: SGLangConfig) -> RetryPolicy:
    """The configured retries and timeout; ``bound_s`` is the longest a request waits for an answer."""
    return RetryPolicy(
        config.max_retries,
        config.backoff_base_s,
        config.backoff_max_s,
        config.dead_after_failures,
        config.request_timeout_s,
    )


async def make_client(urls: list[str], config: SGLangConfig, api_key: ApiKey | None) -> SGLangHTTPClient:
    """A client over ``urls`` with the configured retries and limits (made inside the loop it runs on),
    sending ``api_key`` on every call (``auth.py``)."""
    return SGLangHTTPClient(
        urls,
        retry=retry_policy(config),
        max_concurrency=config.max_concurrency,
        connect_timeout_s=config.connect_timeout_s,
        keepalive_expiry_s=config.keepalive_expiry_s,
        api_key=api_key,
    )


class ServerCalls:
    """``client`` driven from synchronous code through ``loop``."""

    def __init__(self, client: SGLangHTTPClient, loop: LoopThread):
        self.client = client
        self.loop = loop

    def on_all(self, servers: list[ServerState], method: str, path: str, payload: dict | None) -> list[Any]:
        return self.loop.run(self.all(servers, method, path, payload))

    async def all(self, servers: list[ServerState], method: str, path: str, payload: dict | None) -> list[Any]:
        """The call on every server of ``servers`` still alive (see the module's design notes)."""
        live = [server for server in servers if server.alive]
        results = await asyncio.gather(
            *[self.client.call(server, method, path, payload) for server in live], return_exceptions=True
        )
        answers = []
        for server, result in zip(live, results, strict=True):
            if not isinstance(result, BaseException):
                answers.append(result)
            elif server.alive or isinstance(result, asyncio.CancelledError):
                raise result
            else:
                warnings.warn(f"{server.url} died during {path} and is dropped: {result}", RuntimeWarning, stacklevel=2)
        if not any(server.alive for server in live):
            raise NoServersLeftError(f"no SGLang server is left alive after {path}:\n" + self.client.pool.describe())
        return answers

    def best_effort(self, servers: list[ServerState], path: str, payload: dict | None) -> None:
        """Send a clean-up call to every server; failures are reported as warnings, not raised."""

        async def one(server):
            try:
                await self.client.call(server, "POST", path, payload)
            except Exception as error:  # noqa: BLE001
                warnings.warn(f"{path} on {server.url} failed during clean-up: {error}", RuntimeWarning, stacklevel=2)

        self.loop.run(gather([one(server) for server in servers]))
