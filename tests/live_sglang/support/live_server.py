"""Where the live tier's server comes from and how the project's SGLangEngine is configured for it."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_venv_setup import wait_for_sglang_setup

from gspo_megatron.rollout.sglang.config import SGLangConfig
from gspo_megatron.rollout.sglang.engine import SGLangEngine

SKIP_ENV = "GSPO_SKIP_SGLANG"
LIVE_DIR = Path(__file__).resolve().parents[1]
REPO = LIVE_DIR.parents[1]
LIVE_VENV = REPO / ".venv-sglang"
CPU_LAUNCHER = REPO / "launch" / "sglang_cpu" / "launch_server.py"
# The launch that works on a 2-core CPU (issue 27); each flag's reason is in docs/sglang.md.
CPU_SERVER_ARGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--skip-server-warmup",
    "--disable-overlap-schedule",
    "--max-total-tokens",
    "8192",
    "--mem-fraction-static",
    "0.05",
    # a cached prompt prefix is computed by other kernel shapes than a fresh one (last-bit differences):
    # the tier compares outputs across weight updates exactly, so every prompt is computed afresh
    "--disable-radix-cache",
    # an idle scheduler otherwise polls its sockets in a busy loop: 0.7 of a core per server measured here
    # (issue 65), taken from the trainer, the other servers and every later test of the session; with it the
    # loop blocks in zmq's poll, which returns as soon as a request arrives
    "--sleep-on-idle",
    "--log-level",
    "warning",
]
# The variable holding the tier's API key (rollout.sglang.api_key_env): every server of the session, launched
# or attached to, and the training runs (their ranks inherit the environment) use the one key.
LIVE_KEY_ENV = "GSPO_LIVE_SGLANG_KEY"
STARTUP_TIMEOUT_S = 600.0  # 1-2.5 minutes quiet; below pytest's 900 s so the log tail is reported


def server_python() -> Path:
    """The interpreter the server runs in: the live venv's, else this one if it imports SGLang."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"the live SGLang tier is switched off ({SKIP_ENV}=1)")
    wait_for_sglang_setup()  # the set-up may be making the venv in the background while the other tiers run
    venv_python = LIVE_VENV / "bin" / "python"
    if (LIVE_VENV / ".gspo-sglang-stamp").exists():  # written by the set-up once the venv imports SGLang
        return venv_python
    probe = subprocess.run([sys.executable, "-c", "import sglang.launch_server"], capture_output=True, text=True)
    if probe.returncode == 0:
        return Path(sys.executable)
    pytest.fail(
        f"no SGLang to run a live server: make its venv with `bash launch/setup_sglang.sh` "
        f"(launch/setup_tests.sh does it), or set {SKIP_ENV}=1 where it is intentionally absent\n{probe.stderr[-600:]}",
        pytrace=False,
    )


def live_config(**overrides) -> SGLangConfig:
    """The tier's SGLangConfig: the CPU launcher under the server's python, gloo weight sync, the tier's key."""
    os.environ.setdefault(LIVE_KEY_ENV, "gspo-live-" + secrets.token_urlsafe(32))
    values: dict = dict(
        api_key_env=LIVE_KEY_ENV,
        launch_command=[str(server_python()), str(CPU_LAUNCHER)],
        extra_args=list(CPU_SERVER_ARGS),
        enable_return_routed_experts=True,
        startup_timeout_s=STARTUP_TIMEOUT_S,
        request_timeout_s=600.0,
        weight_sync_backend="gloo",
        weight_sync_timeout_s=300.0,
        pause_mode="abort",
    )
    values.update(overrides)
    return SGLangConfig(**values)


def launch_live_server(checkpoint: Path, work: Path, group_name: str) -> SGLangEngine:
    """A real server of ``checkpoint`` launched by the project's engine (launch mode), writing under ``work``."""
    return SGLangEngine(
        live_config(
            mode="launch",
            model_path=str(checkpoint),
            log_dir=str(work / "logs"),
            disk_sync_dir=str(work / "disk_sync"),
            weight_sync_group_name=group_name,
        )
    )


def attached_run_overrides(url: str, checkpoint, tmp_path) -> list[str]:
    """A training run's keys to attach to the session's server ``url`` with its API key, syncing by tensor handles
    (no disk fallback) and a long request timeout for the loaded CPU server."""
    return [
        "rollout.sglang.mode=attach",
        f"rollout.sglang.api_key_env={LIVE_KEY_ENV}",
        f"rollout.sglang.urls=[{url}]",
        f"rollout.sglang.model_path={checkpoint}",
        f"rollout.sglang.disk_sync_dir={tmp_path / 'disk_sync'}",
        "rollout.sglang.weight_sync=tensor",
        "rollout.sglang.fallback_to_disk=false",
        "rollout.sglang.request_timeout_s=600",
    ]
