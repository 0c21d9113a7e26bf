"""The API key that makes an SGLang server answer to this run only.

SGLang 0.5.23 (``sglang/srt/utils/auth.py``, ``decide_request_auth``; wired in ``http_server.py`` when
``--api-key`` is set): every route but ``/health*``, ``/ready*``, ``/metrics*`` and OPTIONS requires the
header ``Authorization: Bearer <key>`` (the scheme case-insensitive, the key compared in constant time);
without it the answer is HTTP 401 ``{"error": "Unauthorized"}``.

Design decisions:
- Launched servers get a fresh key per run (``new_launch_key``), unless ``rollout.sglang.api_key_env``
  names a variable holding one (so that other processes, which know it, can attach). It reaches SGLang
  through a private ``--config`` YAML file (0600, in a 0700 directory, removed once the servers are up), never through
  argv, which every local user can read in ``/proc/<pid>/cmdline``. SGLang logs its resolved server
  arguments, key included, so the launcher writes the server logs 0600 (``launcher.py``).
- Attached servers: the key comes from the environment variable named by ``rollout.sglang.api_key_env``;
  the config holds the variable's name, so config.yaml and the logs never hold the key.
- A key in ``rollout.sglang.extra_args`` is refused: it would be written into config.yaml, and the
  launcher's own key would clash with it. So is an extra ``--config`` (SGLang takes one config file).
- A server that answers without the key although one is configured is refused at start-up
  (``SGLangHTTPClient.check_key_enforced``): an attached server started without ``--api-key``, or a
  wrapper in ``launch_command`` that drops SGLang's ``--config``, leaves the server open to every local
  user, and the run would not notice (SGLang's own check: its middleware is added in single-tokenizer
  mode only; more tokenizer workers refuse to start with a key).
- The key is held in ``ApiKey``, whose repr hides it, so no error message, log line or pickled brief's
  repr prints it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

KEY_FLAGS = ("--api-key", "--admin-api-key")  # SGLang's; refused in extra_args (see the module's notes)
CONFIG_FLAG = "--config"
# Paths SGLang serves without the key (``decide_request_auth``'s prefixes): the liveness probe needs none.
OPEN_PATH_PREFIXES = ("/health", "/ready", "/metrics")
UNAUTHORIZED_BODY = {"error": "Unauthorized"}  # SGLang's answer to a missing or wrong key, with HTTP 401


@dataclass(frozen=True)
class ApiKey:
    """A server's API key; ``repr`` and ``str`` never show it (``value`` does)."""

    value: str = field(repr=False)

    def __str__(self) -> str:
        return "ApiKey(<hidden>)"

    def header(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.value}"}


def new_launch_key() -> ApiKey:
    """A fresh key for this run's servers. The prefix keeps it from starting with ``-`` (which argparse,
    reading SGLang's config file as argv, would take for a flag)."""
    return ApiKey("gspo-" + secrets.token_urlsafe(32))


def key_from_environment(variable: str | None) -> ApiKey | None:
    """The servers' key, from the environment variable ``rollout.sglang.api_key_env`` names."""
    if not variable:
        return None
    value = os.environ.get(variable, "")
    if not value:
        raise ValueError(
            f"rollout.sglang.api_key_env={variable} but the environment variable {variable} is unset or empty: "
            f"export {variable}=<the servers' key: attached ones were started with it (--api-key)>"
        )
    return ApiKey(value)


def refuse_key_flags(extra_args: Sequence[str]) -> None:
    """``--api-key``/``--admin-api-key``/``--config`` in ``rollout.sglang.extra_args`` are refused (why: the
    module's notes)."""
    for arg in extra_args:
        flag = str(arg).split("=", 1)[0]
        if flag in KEY_FLAGS:
            raise ValueError(
                f"rollout.sglang.extra_args holds {flag}: a key there is written into config.yaml. Launched servers "
                "get a fresh API key each run, which the client sends; to choose the key, name an environment "
                "variable holding it in rollout.sglang.api_key_env. Remove it from extra_args"
            )
        if flag == CONFIG_FLAG:
            raise ValueError(
                "rollout.sglang.extra_args holds --config: the launcher passes the servers' API key in its own "
                "SGLang config file and SGLang takes only one; put those options in extra_args instead"
            )


@contextlib.contextmanager
def private_key_config(key: ApiKey) -> Iterator[Path]:
    """A YAML file only this user can read, holding ``api-key``, for SGLang's ``--config``; removed on exit."""
    directory = Path(tempfile.mkdtemp(prefix="gspo-sglang-key-"))  # 0700
    path = directory / "api_key.yaml"
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(f'api-key: "{key.value}"\n')  # token_urlsafe: no quote or backslash to escape
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)
