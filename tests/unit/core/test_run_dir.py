"""Run-directory writer/reader: round trip from tensors, partial last lines, bad directories."""

import json
import math

import pytest
import torch

from gspo_megatron.core.run_dir import JsonlLog, RunDirError, load_run, read_jsonl, to_jsonable
from gspo_megatron.policy.routing.log import RoutingLog, routing_record
from gspo_megatron.policy.routing.volatility import expert_load, routing_volatility

A = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [1, 3]]])
B = torch.tensor([[[1, 0], [2, 4]], [[6, 7], [7, 6]], [[2, 0], [3, 5]]])


def test_routing_log_round_trip_from_tensors(tmp_path):
    with RoutingLog(tmp_path) as log:
        log.log(
            5,
            "update",
            volatility=routing_volatility(A, B),
            load=expert_load(B, 8),
        )
        log.log(6, "rollout_vs_train", volatility=routing_volatility(A, A))
    records = read_jsonl(tmp_path / "routing.jsonl")
    assert [r["step"] for r in records] == [5, 6]
    first = records[0]
    assert first["kind"] == "update"
    assert first["changed_frac"] == pytest.approx([1 / 3, 2 / 3])
    assert first["changed_frac_overall"] == pytest.approx(0.5)
    assert first["overlap_overall"] == pytest.approx(2 / 3)
    assert first["experts_changed_per_slot"] == pytest.approx(1 / 3)
    assert first["tokens"] == 3 and isinstance(first["tokens"], int)
    # B layer 0 picks 1,0 | 6,7 | 2,0 over 8 experts: counts [2,1,1,0,0,0,1,1] of 6 assignments
    assert first["expert_load"][0] == pytest.approx([2 / 6, 1 / 6, 1 / 6, 0, 0, 0, 1 / 6, 1 / 6])
    assert first["load_imbalance"][0] == pytest.approx(2 / 0.75)
    assert records[1]["changed_frac_overall"] == 0.0 and "expert_load" not in records[1]


def test_reader_drops_partial_last_line_and_writer_repairs_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "reward/mean": 0.5}\n{"step": 1, "rew')
    assert read_jsonl(path) == [{"step": 0, "reward/mean": 0.5}]
    with JsonlLog(path) as log:  # a resumed run appends after cutting the fragment
        log.append({"step": 1, "reward/mean": torch.tensor(0.75)})
    assert path.read_text() == '{"step": 0, "reward/mean": 0.5}\n{"step": 1, "reward/mean": 0.75}\n'
    assert read_jsonl(path)[1] == {"step": 1, "reward/mean": 0.75}


def test_reader_fails_on_corrupt_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1,,}\n{"step": 2}\n')
    with pytest.raises(RunDirError, match=r"metrics.jsonl:2: not valid JSON"):
        read_jsonl(path)


def test_to_jsonable_and_nan():
    record = to_jsonable({"a": torch.tensor([1.5, float("nan")]), "b": (torch.tensor(3),), "c": None})
    assert record["b"] == [3] and math.isnan(record["a"][1])
    assert json.loads(json.dumps(record))["a"][0] == 1.5
    with pytest.raises(TypeError, match="cannot write object"):
        to_jsonable({"x": object()})


def test_routing_record_rejects_unknown_kind():
    with pytest.raises(ValueError, match="valid kinds"):
        routing_record(0, "after_update")


def test_load_run_label_and_errors(tmp_path):
    run = tmp_path / "exp1"
    run.mkdir()
    with pytest.raises(RunDirError, match="not a run directory: it has no metrics.jsonl"):
        load_run(run)
    with pytest.raises(RunDirError, match="does not exist"):
        load_run(tmp_path / "missing")
    (run / "metrics.jsonl").write_text('{"step": 0, "reward/mean": 1.0}\n')
    with pytest.raises(RunDirError, match="is a file"):
        load_run(run / "metrics.jsonl")
    assert load_run(run).label == "exp1"  # no config.yaml: directory name
    (run / "config.yaml").write_text("algorithm:\n  name: gspo\n  eps_low: 0.0003\n")
    loaded = load_run(run)
    assert loaded.label == "gspo" and loaded.routing == []
    assert loaded.metric_series("reward/mean") == ([0], [1.0])


def test_drop_records_from_step_for_resume(tmp_path):
    from gspo_megatron.core.run_dir import drop_records_from_step

    with RoutingLog(tmp_path) as log:
        for step in range(4):
            log.log(step, "update", volatility=routing_volatility(A, B))
    assert drop_records_from_step(tmp_path / "routing.jsonl", 2) == 2
    assert [r["step"] for r in read_jsonl(tmp_path / "routing.jsonl")] == [0, 1]
    assert drop_records_from_step(tmp_path / "absent.jsonl", 2) == 0


_FILE_SIZE_LIMITED_WRITER = """
import json, resource, signal, sys
from gspo_megatron.core.run_dir import JsonlLog
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, not a signal
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
log = JsonlLog(sys.argv[1])
try:
    for step in range(100):
        log.append({"step": step, "pad": "x" * 300})
except OSError as error:
    print(json.dumps({"type": type(error).__name__, "errno": error.errno, "message": str(error)}))
finally:
    log.close()
"""


def test_a_failed_append_leaves_whole_lines_and_names_the_file_and_the_fix(tmp_path):
    """Issue 63 item 7: a write that fails mid-record (here a real file-size limit, RLIMIT_FSIZE in a
    child process: the kernel writes up to the limit, then refuses with EFBIG, as a full disk refuses
    with ENOSPC) left metrics.jsonl ending in a partial line behind a bare ``[Errno 27] File too large``.
    The file is cut back to its whole lines, and the error names the file, the bytes and the fix."""
    import errno
    import subprocess
    import sys

    path = tmp_path / "metrics.jsonl"
    limit = 1000  # three 323-byte records fit, the fourth is cut at the limit
    done = subprocess.run(
        [sys.executable, "-c", _FILE_SIZE_LIMITED_WRITER, str(path), str(limit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    failure = json.loads(done.stdout)
    assert failure["errno"] == errno.EFBIG
    assert failure["type"] == "RunLogWriteError"
    assert str(path) in failure["message"] and "323-byte record" in failure["message"]
    assert "ulimit -f" in failure["message"] and "checkpoint.resume=true" in failure["message"]
    data = path.read_bytes()
    assert data.endswith(b"\n") and len(data) < limit
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]


def test_a_full_device_leaves_whole_lines_and_names_the_fix(tmp_path):
    """The disk-full case of the test above, on a real full device: a 64 kB tmpfs in a private mount
    namespace (``unshare -m``), filled by records until the write fails with ENOSPC. Skipped where the
    machine does not allow mounting one."""
    import errno
    import shlex
    import shutil
    import subprocess
    import sys

    device = tmp_path / "device"
    device.mkdir()
    path = device / "metrics.jsonl"
    writer = shlex.join([sys.executable, "-c", _FILE_SIZE_LIMITED_WRITER.replace("100)", "1000)"), str(path), "-1"])
    kept = tmp_path / "kept.jsonl"
    script = f"mount -t tmpfs -o size=64k tmpfs {shlex.quote(str(device))} && {writer} && cp {path} {kept}"
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=60)
    if "mount:" in done.stderr:
        pytest.skip("this machine does not allow a tmpfs in a private mount namespace (unshare -m)")
    assert done.returncode == 0, done.stderr
    failure = json.loads(done.stdout)
    assert failure["errno"] == errno.ENOSPC and failure["type"] == "RunLogWriteError"
    assert str(path) in failure["message"] and "free space on the device holding it" in failure["message"]
    data = kept.read_bytes()
    assert data.endswith(b"\n")
    assert [r["step"] for r in read_jsonl(kept)] == list(range(len(data.splitlines())))


def test_summary_windows_are_fifths_of_the_finite_values():
    from gspo_megatron.core.run_dir import window_mean

    values = [float(i) for i in range(10)] + [float("nan"), None]  # the NaN and the missing step do not count
    assert window_mean(values, "first 20%") == 0.5 and window_mean(values, "last 20%") == 8.5
    assert window_mean(values, "whole run") == 4.5 and window_mean([1.0, 3.0], "last 20%") == 3.0
    assert window_mean([None, float("nan")], "whole run") is None
    with pytest.raises(ValueError, match="unknown summary window 'last 10%'; valid windows: first 20%, last 20%"):
        window_mean([1.0], "last 10%")
