"""Async HTTP client over one or more SGLang servers: load balancing, retries, dead-server failover.

Design decisions:
- One ``httpx.AsyncClient`` and one semaphore (``max_concurrency``) for all servers; a request holds
  the semaphore only while on the wire, never while backing off.
- Load balancing is least-in-flight (ties: the server that has served fewer requests), which spreads
  long and short generations better than round robin.
- Failure classes: 4xx -> ``RequestRejectedError`` at once (our request is wrong, retrying cannot
  help); 5xx (503 while starting) and timeouts -> retried with exponential backoff
  (``base * 2**attempt``, capped); connection failures (refused, reset, closed mid-answer) count
  towards marking the server dead after ``dead_after_failures`` in a row. A request that was on a
  server that died is re-sent to another server without spending its retry budget; when no server
  is alive, ``NoServersLeftError`` names every server and its last error.
- Control calls (weight sync, pause, flush) go to one named server with no failover: every server
  must take them, so a failure there is an error, not something to route around.
- Every wait has a bound a user can read: a request that never gets an answer fails after
  ``RetryPolicy.bound_s`` (each attempt waits ``request_timeout_s``, then backs off; see the arithmetic
  in ``SGLangConfig``), with an error naming the keys. Long before that, once half of
  ``request_timeout_s`` has passed on the wire, a warning names the server, the path and the key -- once
  per server until it answers again, not once per request: a stuck server holds hundreds of requests,
  and hundreds of identical lines would bury the one that matters.
- With an API key (``auth.py``) every request but the ``/health`` probe carries
  ``Authorization: Bearer <key>``; a 401 names the key as the cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any

import httpx

from gspo_megatron.rollout.sglang.auth import ApiKey
from gspo_megatron.rollout.sglang.health import PROBE_TIMEOUT_S, wait_until_healthy


class SGLangClientError(RuntimeError):
    """Base class of the client's errors."""


class NoServersLeftError(SGLangClientError):
    """Every server is dead; the message names each one and its last error."""


class RequestRejectedError(SGLangClientError):
    """A server answered 4xx: the request itself is wrong."""


class RequestFailedError(SGLangClientError):
    """A request failed on every retry (5xx, timeouts, malformed JSON)."""


@dataclass
class ServerState:
    url: str
    in_flight: int = 0
    served: int = 0
    alive: bool = True
    consecutive_failures: int = 0
    last_error: str | None = None
    slow_warned: bool = False  # the half-timeout warning was given; cleared when the server answers


SLOW_FRACTION = 0.5  # a request on the wire this fraction of request_timeout_s gets a warning


@dataclass
class RetryPolicy:
    """How often a request is tried and how long each attempt may wait (``SGLangConfig``'s keys)."""

    max_retries: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 15.0
    dead_after_failures: int = 2
    request_timeout_s: float = 600.0

    def backoff(self, attempt: int) -> float:
        # Exponential backoff: base * 2**attempt, capped.
        return min(self.backoff_max_s, self.backoff_base_s * (2**attempt))

    @property
    def attempts(self) -> int:
        return self.max_retries + 1

    @property
    def bound_s(self) -> float:
        """The longest one request waits on a server that accepts it and never answers: every attempt
        times out and backs off before the next, ``timeout * attempts + sum(backoffs)``."""
        return self.request_timeout_s * self.attempts + sum(self.backoff(a) for a in range(self.max_retries))

    def describe_bound(self) -> str:
        return (
            f"{self.attempts} attempts (rollout.sglang.max_retries={self.max_retries}) of "
            f"rollout.sglang.request_timeout_s={self.request_timeout_s:g} s each, {self.bound_s:.0f} s in all"
        )


@dataclass
class ServerPool:
    """The servers and their load; picks the least-loaded live one."""

    servers: list[ServerState] = field(default_factory=list)

    @classmethod
    def from_urls(cls, urls: list[str]) -> ServerPool:
        if len(set(urls)) != len(urls):
            raise ValueError(f"server urls contain duplicates: {urls}")
        return cls([ServerState(url.rstrip("/")) for url in urls])

    def alive(self) -> list[ServerState]:
        return [server for server in self.servers if server.alive]

    def pick(self) -> ServerState:
        live = self.alive()
        if not live:
            raise NoServersLeftError("no SGLang server is left alive:\n" + self.describe())
        return min(live, key=lambda server: (server.in_flight, server.served))

    def describe(self) -> str:
        return "\n".join(
            f"  {server.url}: {'alive' if server.alive else 'DEAD'}, served {server.served}, "
            f"last error: {server.last_error or '-'}"
            for server in self.servers
        )


_CONNECTION_ERRORS = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def _is_torn_down_socket(error: AttributeError) -> bool:
    """A server that dies while httpcore opens a connection can surface as anyio's SocketStream asking a
    socket that is already gone (``'NoneType' object has no attribute 'getpeername'``, seen with anyio
    4.16 / httpcore 1.0.9): that is a lost connection, not a bug of ours."""
    return "NoneType" in str(error) and ("getpeername" in str(error) or "getsockname" in str(error))


class SGLangHTTPClient:
    """Sends JSON requests to a pool of SGLang servers; must be used inside one event loop."""

    def __init__(
        self,
        urls: list[str],
        *,
        retry: RetryPolicy,
        max_concurrency: int = 256,
        connect_timeout_s: float = 10.0,
        keepalive_expiry_s: float = 2.0,
        api_key: ApiKey | None = None,
    ):
        self.pool = ServerPool.from_urls(urls)
        self.api_key = api_key
        self._auth_headers = api_key.header() if api_key is not None else {}
        self.retry = retry
        self._semaphore = asyncio.Semaphore(max_concurrency)
        # a non-streaming /generate sends nothing until its sample is complete, so the read timeout
        # bounds the whole generation (time paused for a weight sync included)
        timeout = httpx.Timeout(retry.request_timeout_s, connect=connect_timeout_s)
        # keep-alive shorter than the server's, so a pooled connection is never reused as it closes
        limits = httpx.Limits(
            max_connections=max_concurrency,
            max_keepalive_connections=max_concurrency,
            keepalive_expiry=keepalive_expiry_s,
        )
        self._http = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def post_balanced(self, path: str, payload: dict[str, Any]) -> Any:
        """POST to the least-loaded live server; fail over to others when one dies."""
        response, _ = await self.post_preferring(None, path, payload)
        return response

    async def post_preferring(
        self, preferred: ServerState | None, path: str, payload: dict[str, Any]
    ) -> tuple[Any, ServerState]:
        """POST to ``preferred`` while it is alive, else to the least-loaded live server (a server that
        dies under the request has it re-sent elsewhere); returns the answer and the server that gave it."""
        attempt = 0
        while True:
            server = preferred if preferred is not None and preferred.alive else self.pool.pick()
            try:
                return await self._send(server, "POST", path, payload), server
            except _Retryable as failure:
                if not server.alive:
                    continue  # the server died under this request: re-send elsewhere, budget intact
                if attempt >= self.retry.max_retries:
                    raise RequestFailedError(
                        f"POST {path} failed {attempt + 1} times; last on {server.url}: {failure}"
                        f"{self._timeout_advice(failure)}\n" + self.pool.describe()
                    ) from None
                await asyncio.sleep(self.retry.backoff(attempt))
                attempt += 1

    async def call(self, server: ServerState, method: str, path: str, payload: dict | None = None) -> Any:
        """Send to one given server, retrying 5xx/timeouts on that server only (control calls)."""
        attempt = 0
        while True:
            try:
                return await self._send(server, method, path, payload)
            except _Retryable as failure:
                if not server.alive or attempt >= self.retry.max_retries:
                    raise RequestFailedError(
                        f"{method} {path} on {server.url} failed after {attempt + 1} attempts: {failure}"
                        f"{self._timeout_advice(failure)}"
                    ) from None
                await asyncio.sleep(self.retry.backoff(attempt))
                attempt += 1

    async def wait_healthy(self, deadline_s: float, poll_interval_s: float, progress_every_s: float = 10.0) -> None:
        """Poll every server's /health until it answers 200 (503 and refused connections mean 'not yet');
        print a line per server every ``progress_every_s`` while waiting."""
        end = asyncio.get_running_loop().time() + deadline_s  # one deadline for the whole pool
        for server in self.pool.servers:
            url = server.url

            def give_up(last: str, url: str = url) -> Exception:
                return SGLangClientError(
                    f"SGLang server {url} not healthy after {deadline_s:.0f}s (last: {last}); "
                    f"check the URL, or raise SGLangConfig.attach_timeout_s if the server is still loading"
                )

            def progress(waited_s: float, last: str, url: str = url) -> None:
                print(
                    f"[sglang] waiting for {url}/health: {waited_s:.0f}s of {deadline_s:.0f}s, last: {last}", flush=True
                )

            await wait_until_healthy(
                self._http,
                url,
                end,
                poll_interval_s,
                give_up=give_up,
                progress=progress,
                progress_every_s=progress_every_s,
            )

    def _timeout_advice(self, failure: _Retryable) -> str:
        if not failure.timed_out:
            return ""
        return (
            f"; no answer within {self.retry.describe_bound()}: check the server (its log, its load), or "
            "raise rollout.sglang.request_timeout_s if its generations are this long"
        )

    def _warn_slow(self, server: ServerState, method: str, path: str) -> None:
        """Half the timeout has passed on the wire (see the module's design notes)."""
        if server.slow_warned:
            return
        server.slow_warned = True
        warnings.warn(
            f"SGLang server {server.url}: {method} {path} has had no answer for "
            f"{SLOW_FRACTION * self.retry.request_timeout_s:g} s, {SLOW_FRACTION:.0%} of "
            f"rollout.sglang.request_timeout_s; a request with no answer fails after {self.retry.describe_bound()}",
            RuntimeWarning,
            stacklevel=1,
        )

    @contextlib.contextmanager
    def _watched(self, server: ServerState, method: str, path: str):
        loop = asyncio.get_running_loop()
        timer = loop.call_later(SLOW_FRACTION * self.retry.request_timeout_s, self._warn_slow, server, method, path)
        try:
            yield
        finally:
            timer.cancel()

    async def check_key_enforced(self) -> None:
        """With a key: every server must refuse a request without it (HTTP 401), else it is refused here --
        a server that does not enforce the key takes orders from anyone who can reach it."""
        if self.api_key is None:
            return
        for server in self.pool.servers:
            # no Authorization header; bounded like a health probe (it just answered /health)
            response = await self._http.get(server.url + "/server_info", timeout=PROBE_TIMEOUT_S)
            if response.status_code != 401:
                raise SGLangClientError(
                    f"SGLang server {server.url} answered GET /server_info without the API key (HTTP "
                    f"{response.status_code}): it does not enforce the key, so anyone who can reach it can change "
                    "its weights. Start it with --api-key <the key in rollout.sglang.api_key_env's variable> (a "
                    "launched one: a wrapper in rollout.sglang.launch_command must pass SGLang's --config on)"
                )

    async def _send(self, server: ServerState, method: str, path: str, payload: dict | None) -> Any:
        async with self._semaphore, _tracked(server):
            try:
                with self._watched(server, method, path):
                    response = await self._http.request(
                        method, server.url + path, json=payload, headers=self._auth_headers
                    )
            except _CONNECTION_ERRORS as error:
                self._connection_failed(server, f"{type(error).__name__}: {error or 'connection lost'}")
                raise _Retryable(server.last_error) from None
            except AttributeError as error:
                if not _is_torn_down_socket(error):
                    raise
                self._connection_failed(server, f"connection lost while opening it ({error})")
                raise _Retryable(server.last_error) from None
            except httpx.TimeoutException as error:
                server.last_error = f"timeout ({type(error).__name__})"
                raise _Retryable(server.last_error, timed_out=True) from None
        server.consecutive_failures = 0
        server.slow_warned = False
        if response.status_code == 503 and _is_abort(response):
            server.served += 1
            return response.json()  # a non-streaming abort is a 503 carrying the partial sample
        if response.status_code >= 500:
            server.last_error = f"HTTP {response.status_code}: {response.text[:200]}"
            raise _Retryable(server.last_error)
        if response.status_code == 401:
            raise RequestRejectedError(
                f"{method} {path} on {server.url} was refused with HTTP 401 ({response.text[:200]}): the server "
                + (
                    "refused this run's API key"
                    if self.api_key is not None
                    else "requires an API key; name the environment variable holding it in rollout.sglang.api_key_env"
                )
            )
        if response.status_code >= 400:
            raise RequestRejectedError(
                f"{method} {path} on {server.url} was rejected with HTTP {response.status_code}: {response.text[:500]}"
            )
        server.served += 1
        if not response.content:
            return None
        content_type = response.headers.get("content-type", "")
        if "json" not in content_type:
            return response.text
        try:
            return response.json()
        except ValueError:
            raise RequestFailedError(
                f"{method} {path} on {server.url} answered malformed JSON: {response.text[:200]!r}"
            ) from None

    def _connection_failed(self, server: ServerState, message: str) -> None:
        server.last_error = message
        server.consecutive_failures += 1
        if server.consecutive_failures >= self.retry.dead_after_failures:
            server.alive = False


class _Retryable(Exception):
    def __init__(self, message: str | None, *, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def _is_abort(response: httpx.Response) -> bool:
    try:
        body = response.json()
    except ValueError:
        return False
    meta = body.get("meta_info") if isinstance(body, dict) else None
    reason = meta.get("finish_reason") if isinstance(meta, dict) else None
    return isinstance(reason, dict) and reason.get("type") == "abort"


@contextlib.asynccontextmanager
async def _tracked(server: ServerState):
    server.in_flight += 1
    try:
        yield
    finally:
        server.in_flight -= 1
