"""How ``python -m gspo_megatron.train`` ends (``train.exit_without_teardown``): its atexit handlers run
and its exit status is kept, but the interpreter's module teardown (1.8 s of the main job's exit on 2
cores) is skipped, as ``multiprocessing`` skips it in its children. A ``sitecustomize`` in the child's
path marks both: an atexit handler, and a module global whose finalizer runs only in the teardown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.testing.train_runs import FAST, train_command

pytestmark = pytest.mark.e2e

MARKERS = """
import atexit, os
_DIR = os.environ["EXIT_MARKERS"]
def _mark(what):
    with open(os.path.join(_DIR, f"{what}-{os.getpid()}"), "w"):
        pass
atexit.register(_mark, "atexit")
class _Teardown:  # holds what its finalizer needs: module globals may be gone by then
    def __init__(self):
        self.dir, self.join, self.getpid, self.open = _DIR, os.path.join, os.getpid, open
    def __del__(self):
        with self.open(self.join(self.dir, f"teardown-{self.getpid()}"), "w"):
            pass
_held_until_teardown = _Teardown()
"""


def _marking_env(tmp_path) -> tuple[dict[str, str], Path]:
    """(this environment with the marking sitecustomize first on the path, the folder of the marks)."""
    site, markers = tmp_path / "site", tmp_path / "markers"
    site.mkdir()
    markers.mkdir()
    (site / "sitecustomize.py").write_text(MARKERS)
    env = dict(os.environ, EXIT_MARKERS=str(markers))
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    return env, markers


def _run(tmp_path, overrides):
    env, markers = _marking_env(tmp_path)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("WORLD_SIZE", None)
    run = subprocess.Popen(
        train_command(overrides, tmp_path / "run"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = run.communicate(timeout=600)
    return run, out, err, {p.name for p in markers.iterdir()}


def test_a_finished_run_runs_its_atexit_handlers_and_skips_the_teardown(tmp_path):
    run, out, err, marks = _run(tmp_path, FAST)
    assert run.returncode == 0, err[-3000:]
    assert "run summary: 2 steps" in out
    assert f"atexit-{run.pid}" in marks  # the trainer's handlers ran
    assert f"teardown-{run.pid}" not in marks  # its module teardown did not
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step_000002"


def test_a_refused_config_keeps_its_exit_status(tmp_path):
    run, _, err, marks = _run(tmp_path, [*FAST, "trainer.no_such_key=1"])
    assert run.returncode == 1 and "no_such_key" in err
    assert f"atexit-{run.pid}" in marks and f"teardown-{run.pid}" not in marks


def test_sitecustomize_marks_a_teardown_where_one_happens(tmp_path):
    """The double check: the same markers in a plain interpreter mark both."""
    env, markers = _marking_env(tmp_path)
    run = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], env=env, capture_output=True, text=True
    )
    pid = run.stdout.strip()
    assert {f"atexit-{pid}", f"teardown-{pid}"} <= {p.name for p in markers.iterdir()}


# An executor that lives to the exit with an idle worker thread (non-daemon, blocked on its work queue)
LIVE_EXECUTOR = """
import concurrent.futures
from gspo_megatron.train import exit_without_teardown
executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # never shut down; a module global keeps it
executor.submit(int).result()
exit_without_teardown(7)
"""


def test_an_executor_left_open_does_not_hold_the_exit():
    """Python's exit wakes a live executor's idle workers before it joins the non-daemon threads (the hooks
    of threading._register_atexit); a bare join of every non-daemon thread waited on such a worker forever
    (a qwen3_5_moe_tiny run hung after its summary). The bound is a hang's, not a timing."""
    run = subprocess.Popen([sys.executable, "-c", LIVE_EXECUTOR], stderr=subprocess.PIPE, text=True)
    try:
        _, err = run.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        run.kill()
        run.communicate()
        pytest.fail("exit_without_teardown still joining the executor's idle worker after 120 s")
    assert run.returncode == 7, err[-3000:]
