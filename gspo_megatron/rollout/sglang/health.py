"""Wait until an SGLang server answers ``GET /health`` with 200: the one poller behind both attach
(``client.py``, every server of the pool) and launch (``launcher.py``, a process it started).

SGLang answers 503 while the model loads, and refuses connections before its HTTP server is up:
both mean "not yet". Anything else is retried too until the deadline, and the last answer seen is
what the caller's error quotes.

Each probe has its own timeout, ``PROBE_TIMEOUT_S`` and never past the deadline: the HTTP client's
timeout is the one for ``/generate`` (``request_timeout_s``, 10 min), so a server that accepts the
connection and never answers held the attach that long, ignoring ``attach_timeout_s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

PROBE_TIMEOUT_S = 10.0  # a healthy server answers /health at once; a slow one gets another probe
MIN_PROBE_TIMEOUT_S = 0.05


async def wait_until_healthy(
    http: httpx.AsyncClient,
    url: str,
    deadline: float,
    poll_interval_s: float,
    *,
    give_up: Callable[[str], Exception],
    check: Callable[[], None] | None = None,
    progress: Callable[[float, str], None] | None = None,
    progress_every_s: float = 10.0,
) -> None:
    """Poll ``url/health`` until 200.

    ``deadline``: the event loop's clock (``loop.time()``) at which to stop; then ``give_up(last)``
    is raised, ``last`` describing the last answer. ``check`` runs before every probe and raises to
    abort (the launched process exited). ``progress(waited_s, last)`` is called every
    ``progress_every_s`` while waiting.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    next_report = start + progress_every_s
    last = "no answer yet"
    while True:
        if check is not None:
            check()
        try:
            probe_timeout = max(MIN_PROBE_TIMEOUT_S, min(PROBE_TIMEOUT_S, deadline - loop.time()))
            response = await http.get(url + "/health", timeout=probe_timeout)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}"
        except httpx.TimeoutException as error:  # no connection, or no answer, within the probe's timeout
            # a probe cut short by the deadline is not evidence of a silent server (on a busy machine even a
            # loopback connect can outlast MIN_PROBE_TIMEOUT_S): an answer seen before stays the one quoted
            cut_short = probe_timeout < PROBE_TIMEOUT_S
            if not (cut_short and last.startswith("HTTP ")):
                last = (
                    f"no answer within {probe_timeout:.3g}s (the connection was accepted)"
                    if isinstance(error, httpx.ReadTimeout)
                    else _describe(error)
                )
        except httpx.TransportError as error:
            last = _describe(error)
        now = loop.time()
        if now >= deadline:
            raise give_up(last)
        if progress is not None and now >= next_report:
            progress(now - start, last)
            next_report += progress_every_s
        await asyncio.sleep(poll_interval_s)


def _describe(error: httpx.TransportError) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
