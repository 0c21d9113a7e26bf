"""The run-directory lock and the fresh/resume rules, on real files and real processes."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from gspo_megatron.config.schema import CheckpointSection
from gspo_megatron.core.run_dir import RunDirError, resume_mode
from gspo_megatron.run.run_dir_owner import (
    LOCK_FILE,
    TAKEOVER_FILE,
    RunDirLock,
    _process_start,
    check_fresh_start,
    claim_run_dir,
)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_lock_is_exclusive_and_released(tmp_path):
    lock = RunDirLock.acquire(tmp_path)
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(RunDirError, match=f"in use by pid {os.getpid()}"):
        RunDirLock.acquire(tmp_path)
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    RunDirLock.acquire(tmp_path).release()


def test_lock_held_by_a_live_process_of_this_host_is_respected(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid, "start": None}))
        with pytest.raises(RunDirError, match=f"pid {holder.pid}"):
            RunDirLock.acquire(tmp_path)
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "start": "1"}))
    lock = RunDirLock.acquire(tmp_path)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_lock_of_a_killed_holder_not_yet_reaped_is_taken_over(tmp_path):
    """A SIGKILLed holder stays a zombie until its parent reaps it (a run restarted right after
    ``kill -9``): it still answers kill(pid, 0) but can hold nothing, so its lock is stale."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = _process_start(holder.pid)
        (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid, "start": start}))
        holder.kill()
        os.waitid(os.P_PID, holder.pid, os.WEXITED | os.WNOWAIT)  # dead, and left unreaped
        os.kill(holder.pid, 0)  # a zombie still answers
        lock = RunDirLock.acquire(tmp_path)
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
        lock.release()
    finally:
        holder.kill()
        holder.wait()


def test_reused_pid_makes_a_lock_stale(tmp_path):
    """Our own pid with another start time: the process that wrote the lock is gone."""
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "start": "-1"}))
    RunDirLock.acquire(tmp_path).release()


def test_lock_from_another_host_is_never_taken_over(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": _dead_pid(), "start": "1"}))
    with pytest.raises(RunDirError, match="on host elsewhere"):
        RunDirLock.acquire(tmp_path)


def test_release_leaves_a_lock_that_is_not_ours(tmp_path):
    lock = RunDirLock.acquire(tmp_path)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "start": None}))
    lock.release()
    assert (tmp_path / LOCK_FILE).exists()


def test_fresh_start_rules(tmp_path):
    (tmp_path / ".hydra").mkdir()  # Hydra's own files do not make a run
    check_fresh_start(tmp_path, overwrite=False)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(RunDirError, match=r"already holds a run \(metrics.jsonl\)"):
        check_fresh_start(tmp_path, overwrite=False)
    check_fresh_start(tmp_path, overwrite=True)


@pytest.mark.parametrize("value, mode", [(True, "true"), ("True", "true"), (False, "false"), ("auto", "auto")])
def test_resume_modes(value, mode):
    assert resume_mode(value) == mode


def test_unknown_resume_mode_is_named():
    with pytest.raises(RunDirError, match="checkpoint.resume='sometimes'"):
        resume_mode("sometimes")


def test_claim_refuses_resume_without_checkpoint_and_unlocks(tmp_path):
    section = SimpleNamespace(resume="true", overwrite=False, resume_allow_changes=[])
    with pytest.raises(RunDirError, match="holds no checkpoint.*resume=auto"):
        claim_run_dir(tmp_path, section, "a: 1\n")
    assert not (tmp_path / LOCK_FILE).exists()
    claim = claim_run_dir(tmp_path, SimpleNamespace(resume="auto", overwrite=False, resume_allow_changes=[]), "")
    assert claim.resume_from is None
    claim.release()


def _section(**values) -> CheckpointSection:
    return CheckpointSection(**values)


@pytest.mark.parametrize("content", ["", "{", "null", "[1, 2]"], ids=["empty", "torn", "null", "list"])
def test_lock_naming_no_owner_is_taken_over(tmp_path, content, capsys):
    """D17: an empty or unreadable lock (never one of ours: ours are linked in complete) no longer
    blocks the directory forever with 'pid None on host None'."""
    (tmp_path / LOCK_FILE).write_text(content)
    lock = RunDirLock.acquire(tmp_path)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert "names no owner (empty or damaged): taking it over" in capsys.readouterr().err
    lock.release()


def test_run_that_stopped_before_its_first_save_gets_one_consistent_answer(tmp_path):
    """D10: resume=true used to say 'use auto' and auto said 'resume is off'; both now say the run
    never saved and name the way on (overwrite), and overwrite does start it over."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirError) as as_true:
        claim_run_dir(tmp_path, _section(resume="true"), "")
    with pytest.raises(RunDirError) as as_auto:
        claim_run_dir(tmp_path, _section(resume="auto"), "")
    for refusal in (str(as_true.value), str(as_auto.value)):
        assert "stopped before its first save" in refusal and "checkpoint.overwrite=true" in refusal
        assert "resume is off" not in refusal and "resume=auto to start fresh" not in refusal
    claim = claim_run_dir(tmp_path, _section(resume="auto", overwrite=True), "")
    assert claim.resume_from is None
    claim.release()


def test_refused_claim_leaves_no_directory_behind(tmp_path):
    """A refusal touches no file: the run_dir (and parents) the claim created are removed again."""
    run_dir = tmp_path / "typo" / "run"
    with pytest.raises(RunDirError, match=r"is run_dir right\?"):
        claim_run_dir(run_dir, _section(resume="true"), "")
    assert list(tmp_path.iterdir()) == []


def _make_unwritable(directory) -> list[str]:
    """chmod for an ordinary user; root ignores modes, so the immutable flag there. Returns the undo command."""
    directory.chmod(0o555)
    probe = directory / "probe"
    try:
        probe.write_text("")
    except OSError:
        return ["chmod", "755", str(directory)]
    probe.unlink()
    directory.chmod(0o755)
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode != 0:
        pytest.skip("cannot make a directory unwritable here (root without chattr)")
    return ["chattr", "-i", str(directory)]


def test_unwritable_checkpoints_dir_is_refused_at_the_claim(tmp_path):
    """Found at start-up, not at the first save after a step of work."""
    (tmp_path / "checkpoints").mkdir()
    undo = _make_unwritable(tmp_path / "checkpoints")
    try:
        with pytest.raises(RunDirError, match=r"checkpoints is not writable \(.*\): a run writes its lock, metrics"):
            claim_run_dir(tmp_path, _section(resume="auto", overwrite=True), "")
    finally:
        subprocess.run(undo, check=True)
    assert not (tmp_path / LOCK_FILE).exists()


def test_unwritable_run_dir_is_named_at_the_lock(tmp_path):
    """Issue 63 item 7: the lock's temporary file was the first write, and it failed with a bare
    ``OSError`` (``[Errno 30]`` on a read-only mount) naming neither the run directory nor a fix. Here the
    OS refuses by permissions or ``chattr +i`` (root ignores permissions); the read-only mount itself is
    tests/faults/test_run_dir_faults.py's."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    undo = _make_unwritable(run_dir)
    try:
        with pytest.raises(RunDirError, match=rf"{run_dir} is not writable \(.*\.gspo\.lock\..*\): .*remount"):
            claim_run_dir(run_dir, _section(resume="auto"), "")
    finally:
        subprocess.run(undo, check=True)
    assert list(run_dir.iterdir()) == []


def _race_for_the_locks(run_dirs: list[str], start, done, results) -> None:
    """One contender, in every race in turn: wait for the common start, try the race's lock, report,
    and hold the lock until every contender has tried."""
    for race, run_dir in enumerate(run_dirs):
        start.wait()
        try:
            lock = RunDirLock.acquire(Path(run_dir))
        except RunDirError:
            lock = None
        results.put((race, os.getpid() if lock is not None else None))
        done.wait()
        if lock is not None:
            lock.release()


@pytest.mark.slow
@pytest.mark.parametrize("found", ["empty", "stale"])
def test_exactly_one_owner_when_processes_race_for_a_lock(tmp_path, found):
    """issue 43, N6: two processes taking over an empty lock at the same instant both 'owned' it (2 of 11
    races). 50 races of 8 processes released at one barrier: exactly one owner each time. The same 8
    processes run every race (forking 400 from a test runner of a few GB cost 24 s of the suite)."""
    context = multiprocessing.get_context("fork")
    contenders, races = 8, 50
    dead = {"host": socket.gethostname(), "pid": _dead_pid(), "start": "0"}
    run_dirs = []
    for race in range(races):
        run_dir = tmp_path / f"race_{race}"
        run_dir.mkdir()
        (run_dir / LOCK_FILE).write_text("" if found == "empty" else json.dumps(dead))
        run_dirs.append(str(run_dir))
    # the test joins both barriers: a race starts when it says so and ends when every contender tried
    start, done, results = context.Barrier(contenders + 1), context.Barrier(contenders + 1), context.Queue()
    processes = [
        context.Process(target=_race_for_the_locks, args=(run_dirs, start, done, results)) for _ in range(contenders)
    ]
    for process in processes:
        process.start()
    finished = False
    try:
        for race, run_dir in enumerate(run_dirs):
            start.wait(timeout=60)
            tried = [results.get(timeout=60) for _ in range(contenders)]
            done.wait(timeout=60)  # every contender has tried (the owner still holds the lock)
            assert {r for r, _ in tried} == {race}
            won = [pid for _, pid in tried if pid is not None]
            assert len(won) == 1, f"race {race}: {len(won)} owners {won}"
            assert not (Path(run_dir) / TAKEOVER_FILE).exists()
        finished = True
    finally:
        if not finished:  # the contenders wait at a barrier: break it, they end at once
            start.abort()
            done.abort()
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert all(process.exitcode == 0 for process in processes)
