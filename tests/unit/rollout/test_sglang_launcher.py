"""Launch mode with a fake ``launch_server``: the test double's CLI started as a subprocess."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from gspo_megatron.contracts.samples import SamplingParams
from gspo_megatron.rollout.sglang import SGLangConfig, SGLangEngine
from gspo_megatron.rollout.sglang.launcher import LaunchedServer, ServerLaunchError, build_launch_command

FAKE_LAUNCH_SERVER = [sys.executable, "-m", "gspo_megatron.testing.sglang_double"]


def _config(tmp_path, **overrides):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"num_hidden_layers": 3, "num_experts_per_tok": 2, "num_experts": 4}')
    settings = dict(
        mode="launch",
        model_path=str(model),
        launch_command=FAKE_LAUNCH_SERVER,
        log_dir=str(tmp_path / "logs"),
        startup_timeout_s=60.0,
        health_poll_interval_s=0.05,
        shutdown_grace_s=5.0,
        backoff_base_s=0.01,
    )
    settings.update(overrides)
    return SGLangConfig(**settings)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid, seconds=5.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end and _alive(pid):
        time.sleep(0.05)
    return not _alive(pid)


def test_launch_command_argv():
    argv = build_launch_command(
        [],
        model_path="/m",
        tp=2,
        host="127.0.0.1",
        port=31000,
        enable_return_routed_experts=True,
        enable_deterministic_inference=True,
        extra_args=["--mem-fraction-static", "0.5"],
    )
    assert argv == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/m",
        "--tp-size",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--enable-return-routed-experts",
        "--enable-deterministic-inference",
        "--mem-fraction-static",
        "0.5",
    ]


def test_launch_generate_and_shutdown_only_own_processes(tmp_path):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        config = _config(
            tmp_path, enable_return_routed_experts=True, extra_args=["--startup-503", "3", "--spawn-child"]
        )
        engine = SGLangEngine(config)
        (server,) = engine.launched_servers
        samples = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, n=2, return_routed_experts=True))
        assert samples[0][0].routed_experts.shape[1:] == (3, 2)  # layout read from model/config.json
        log = server.log_path.read_text()
        assert "--enable-return-routed-experts" in log and "--startup-503" in log
        assert f"serving on {server.url}" in log
        child_pid = int(re.search(r"child pid (\d+)", log).group(1))
        leader_pid = server.pid
        assert _alive(child_pid) and _alive(leader_pid)
        engine.shutdown()
        engine.shutdown()  # idempotent
        assert _wait_gone(leader_pid) and _wait_gone(child_pid)  # the server's whole process group
        assert bystander.poll() is None  # a process this engine did not start is untouched
    finally:
        bystander.send_signal(signal.SIGKILL)
        bystander.wait()


def test_a_relative_log_dir_lies_under_the_run_directory_not_the_working_directory(tmp_path, monkeypatch):
    """Issue 63, item 8: the launched servers' logs went to <cwd>/logs/sglang whatever run_dir said."""
    work, run_dir = tmp_path / "cwd", tmp_path / "run"
    work.mkdir()
    run_dir.mkdir()
    monkeypatch.chdir(work)
    engine = SGLangEngine(_config(tmp_path, log_dir="logs/sglang"), run_dir=run_dir)
    try:
        (server,) = engine.launched_servers
        assert server.log_path.parent == run_dir / "logs" / "sglang"
        assert "[sglang double]" in server.log_path.read_text()
    finally:
        engine.shutdown()
    assert list(work.iterdir()) == []


def test_server_exiting_during_start_up_quotes_its_log(tmp_path):
    with pytest.raises(ServerLaunchError, match=r"exited with code 3(.|\n)*exiting on purpose"):
        SGLangEngine(_config(tmp_path, extra_args=["--exit-code", "3"]))


def test_health_deadline_stops_the_server(tmp_path):
    server = LaunchedServer(
        FAKE_LAUNCH_SERVER + ["--port", "0", "--startup-503", "100000"], "http://127.0.0.1:1", tmp_path / "never.log"
    )
    # port 0 + a wrong url: the server runs but /health is never reachable within the deadline
    server.start()
    started = time.monotonic()  # let it come up first: on a loaded machine its start-up alone can take > 1 s
    while "[sglang double]" not in server.log_path.read_text() and time.monotonic() - started < 120:
        time.sleep(0.05)
    with pytest.raises(ServerLaunchError, match=r"not healthy after 1s"):
        server.wait_healthy(timeout_s=1.0, poll_interval_s=0.05)
    assert not server.is_running()
    assert "[sglang double]" in server.log_path.read_text()
