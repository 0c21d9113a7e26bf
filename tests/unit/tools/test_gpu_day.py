"""The GPU day's runner (tools/gpu_day.py) on this machine: its time boxes, the counts it reads off
pytest's closing line, a box that runs out ending the step's whole process session, and the verdicts.
The whole command, up to its CUDA check, in a Python 3.12 venv standing in for the lent machine's image:
tests/e2e/test_gpu_day_dry_run.py."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_day import NO_CUDA_RC, TOTAL_BUDGET_S, Step, StepResult, decide, plan_steps, pytest_counts, run_step

DEVICE_COMMAND_LIMIT_S = 600  # the device tool's limit on one command (/work/.library/device/README.md)


def test_the_boxes_fit_the_budget_and_the_budget_the_device_tools_command_limit():
    boxes = [step.box_s for step in plan_steps("python3", Path("kit"), Path("run"))]
    assert sum(boxes) <= TOTAL_BUDGET_S <= DEVICE_COMMAND_LIMIT_S - 60  # a minute left for the transfers


@pytest.mark.slow
def test_counts_are_read_off_pytests_own_closing_line(tmp_path):
    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert False\n"
        "@pytest.mark.skip(reason='x')\n"
        "def test_skipped(): pass\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert pytest_counts(done.stdout) == {"passed": 1, "failed": 1, "skipped": 1, "errors": 0}
    assert pytest_counts("no test runner here\n") == {}


@pytest.mark.slow
def test_a_box_that_runs_out_ends_the_steps_whole_session(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = f"sleep 600 & echo $! > {pid_file}; echo started; wait"  # a grandchild in the step's session
    step = Step("sleeper", 1, ["bash", "-c", script], stops_the_run=False)
    result = run_step(step, tmp_path / "sleeper.log", dict(os.environ), box_scale=5.0)
    assert result.timed_out and result.rc is None
    assert "started" in result.tail
    try:
        grandchild = os.pidfd_open(int(pid_file.read_text()))
    except ProcessLookupError:
        return  # already gone
    with select.epoll() as poll:  # a pidfd turns readable when its process ends
        poll.register(grandchild, select.EPOLLIN)
        assert poll.poll(timeout=60), "the step's grandchild outlived its box by a minute"
    os.close(grandchild)


def _result(step: str, rc: int | None, tail: str = "") -> StepResult:
    return StepResult(step, step, 10, rc, 1.0, rc is None, {}, tail)


def test_a_dry_run_ends_at_the_cuda_check_naming_what_it_found():
    no_device = "no CUDA device: torch 2.11.0 (CUDA 13.0) sees none"
    results = [_result("install", 0), _result("preflight", 0), _result("cuda", NO_CUDA_RC, no_device)]
    verdict, status = decide(results, dry_run=True)
    assert status == 0 and verdict.startswith("dry run") and no_device in verdict
    verdict, status = decide(results, dry_run=False)
    assert status == 1 and verdict == "failed: cuda"


def test_any_failed_or_boxed_out_step_fails_the_day():
    results = [_result("install", 0), _result("cuda", 0), _result("gpu_tier", None), _result("main_job", 0)]
    assert decide(results, dry_run=False) == ("failed: gpu_tier", 1)
    assert decide(results[:2] + results[3:], dry_run=False) == ("passed: every step", 0)
