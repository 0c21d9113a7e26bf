"""Start an SGLang server process, wait until it is healthy, and stop exactly that process.

Design decisions:
- The server runs in a new session (``start_new_session=True``), so it leads its own process group;
  SGLang forks scheduler / detokenizer children into that group, and shutdown signals the group
  (SIGTERM, then SIGKILL after a grace period). Nothing outside the group is ever signalled, and a
  group is only signalled if this object created it.
- stdout and stderr go to one log file per server; start-up failures quote the log's tail, because
  that is where SGLang explains itself (out of memory, unknown model, bad flag).
- Health polling has a deadline and also watches the process: a server that exits while we wait is
  reported at once with its exit code, not after the deadline.
- ``atexit`` stops the server if the trainer forgets; ``stop()`` is idempotent.
- The log is created 0600: SGLang logs its resolved arguments, the run's API key among them (``auth.py``),
  which reaches it through a ``--config`` file, never argv.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx

from gspo_megatron.core.process_tags import as_own_helper
from gspo_megatron.rollout.sglang.health import wait_until_healthy


class ServerLaunchError(RuntimeError):
    """The server process exited or did not become healthy in time."""


def build_launch_command(
    launch_command: Sequence[str],
    *,
    model_path: str,
    tp: int,
    host: str,
    port: int,
    enable_return_routed_experts: bool,
    enable_deterministic_inference: bool = False,
    extra_args: Sequence[str] = (),
    key_config: Path | None = None,
) -> list[str]:
    """``python -m sglang.launch_server --model-path M --tp-size N --host H --port P [...]`` as argv.

    ``--tp-size`` is SGLang's flag; ``--tp`` works only as an argparse abbreviation of it. ``key_config``:
    the private YAML file holding the API key (``auth.private_key_config``), passed as ``--config``."""
    command = list(launch_command) or [sys.executable, "-m", "sglang.launch_server"]
    command += ["--model-path", str(model_path), "--tp-size", str(tp), "--host", host, "--port", str(port)]
    if enable_return_routed_experts:
        command.append("--enable-return-routed-experts")
    if enable_deterministic_inference:
        command.append("--enable-deterministic-inference")
    if key_config is not None:
        command += ["--config", str(key_config)]
    return command + list(extra_args)


class LaunchedServer:
    """One server process this object started; ``url`` is where it listens."""

    def __init__(self, command: Sequence[str], url: str, log_path: Path):
        self.command = list(command)
        self.url = url
        self.log_path = Path(log_path)
        self._process: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> None:
        if self._process is not None:
            raise RuntimeError(f"server {self.url} was already started (pid {self._process.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(descriptor, 0o600)  # an older log of the same name may be readable by others
        with os.fdopen(descriptor, "ab") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            self._process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own session and process group: stop() signals only it
                env=as_own_helper(),  # the trainer's reaper stops it even outside the trainer's session
            )
        atexit.register(self.stop)

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def wait_healthy(self, timeout_s: float, poll_interval_s: float = 1.0) -> None:
        """Poll GET /health until 200; raise with the log's tail on exit or deadline (stopping the
        server). Runs its own event loop: call it from synchronous code."""

        def exited() -> None:
            code = self._process.poll() if self._process else None
            if code is not None:
                raise ServerLaunchError(
                    f"SGLang server {self.url} exited with code {code} during start-up; command: "
                    f"{' '.join(self.command)}\nlast lines of {self.log_path}:\n{self.log_tail()}"
                )

        def give_up(last: str) -> Exception:
            self.stop()
            return ServerLaunchError(
                f"SGLang server {self.url} not healthy after {timeout_s:.0f}s (last: {last}); "
                f"raise SGLangConfig.startup_timeout_s if the model is large.\n"
                f"last lines of {self.log_path}:\n{self.log_tail()}"
            )

        async def poll() -> None:
            timeout = min(10.0, max(poll_interval_s, 1.0))
            async with httpx.AsyncClient(timeout=timeout, trust_env=False) as http:
                deadline = asyncio.get_running_loop().time() + timeout_s
                await wait_until_healthy(http, self.url, deadline, poll_interval_s, give_up=give_up, check=exited)

        asyncio.run(poll())

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after ``grace_s``; returns the exit code."""
        process = self._process
        if process is None:
            return None
        atexit.unregister(self.stop)
        if process.poll() is None or _group_exists(process.pid):
            self._signal_group(process, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=grace_s)
            # Children may outlive the leader; kill whatever is left of the group.
            self._signal_group(process, signal.SIGKILL)
            process.wait(timeout=grace_s)
        return process.returncode

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    @staticmethod
    def _signal_group(process: subprocess.Popen, sig: int) -> None:
        # The group id is the pid we started (start_new_session); never signal any other group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
