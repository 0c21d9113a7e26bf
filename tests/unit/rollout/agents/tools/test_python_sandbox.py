"""The ``python`` tool (``rollout/agents/tools/python_sandbox.py``) on real processes: it prints a computed
value; an endless loop ends at its CPU or wall limit, an endless allocation as crashed, a 10 MB print as
too_large; forks, subprocesses, sockets and writes outside the scratch directory are refused (and the
file is not there afterwards), while reading the standard library and writing inside scratch work."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from gspo_megatron.rollout.agents.tools.base import ToolResult
from gspo_megatron.rollout.agents.tools.python_sandbox import MiB, PythonSandbox
from gspo_megatron.rollout.agents.tools.runner import ToolRunner

pytestmark = pytest.mark.slow  # every test starts interpreters


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    return tmp_path / "scratch"  # its sibling tmp_path / "outside.txt" is outside it


def _run(scratch: Path, code: str, **limits) -> ToolResult:
    return PythonSandbox(scratch, **limits).call({"code": code})


def test_prints_a_computed_value(scratch):
    assert _run(scratch, "print(sum(i * i for i in range(1, 11)))") == ToolResult("385\n")
    assert _run(scratch, "print('é ✓')") == ToolResult("é ✓\n")  # UTF-8 whatever the locale


def test_an_endless_loop_ends_at_its_cpu_or_wall_limit(scratch):
    result = _run(scratch, "while True: pass", cpu_s=1, wall_timeout_s=5)
    assert result.error in ("crashed", "timeout")  # SIGXCPU after 1 s of CPU, or the wall limit if starved
    if result.error == "crashed":
        assert "SIGXCPU" in result.content


def test_a_sleep_ends_at_the_wall_limit_before_the_runners(scratch):
    sandbox = PythonSandbox(scratch, wall_timeout_s=1)
    assert sandbox.timeout_s > sandbox.wall_timeout_s
    result = asyncio.run(ToolRunner([sandbox]).call("python", {"code": "import time\ntime.sleep(60)"}))
    assert result.error == "timeout"
    assert "wall-clock limit of 1 s" in result.content  # the sandbox's kill, not the runner's abandonment


def test_ten_megabytes_of_output_is_too_large(scratch):
    result = _run(scratch, "print('x' * 10_000_000)")
    assert result.error == "too_large"
    assert "65536 bytes" in result.content and len(result.content) < 200


def test_allocating_without_bound_crashes(scratch):
    result = _run(scratch, "blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))", memory_bytes=256 * MiB)
    assert result.error == "crashed"
    assert "out of memory (the limit is 256 MiB)" in result.content


@pytest.mark.parametrize(
    "code, event",
    [
        ("import os\nos.fork()", "os.fork"),
        ("import socket\nsocket.socket()", "socket.__new__"),
        ("import socket\nsocket.getaddrinfo('localhost', 80)", "socket.getaddrinfo"),
        ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
        ("import os\nos.system('true')", "os.system"),
        ("import os\nos.execv('/bin/true', ['true'])", "os.exec"),
        ("import ctypes", "import _ctypes"),
        ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "resource.setrlimit"),
        ("import os\nos.kill(os.getppid(), 0)", "os.kill"),
        # _posixsubprocess.fork_exec starts a process without an audit event: it is gone, and so is a way back
        ("import _posixsubprocess\n_posixsubprocess.fork_exec", "AttributeError"),
        (
            "import importlib.util, sys\nimportlib.util.module_from_spec(sys.modules['_posixsubprocess'].__spec__)",
            "import _posixsubprocess",
        ),
    ],
)
def test_processes_network_and_escapes_are_refused(scratch, code, event):
    result = _run(scratch, code)
    if event == "AttributeError":
        assert result.error == "raised" and "has no attribute 'fork_exec'" in result.content
    else:
        assert result.error == "refused"
        assert f"SANDBOX-REFUSED: {event}\n" in result.content


def test_a_caught_refusal_is_still_refused(scratch):
    code = "import os\ntry:\n    os.fork()\nexcept PermissionError as error:\n    print('caught', error)"
    result = _run(scratch, code)
    assert result.error == "refused"
    assert "caught sandbox: os.fork is not allowed" in result.content


@pytest.mark.parametrize(
    "template",
    [
        "open({target!r}, 'w').write('x')",
        "open({target!r}, 'a').write('x')",
        "import os\nos.close(os.open({target!r}, os.O_WRONLY | os.O_CREAT))",
        "import pathlib\npathlib.Path({target!r}).write_text('x')",
        "open('inside.txt', 'w').close()\nimport os\nos.rename('inside.txt', {target!r})",
        "import os, pathlib\nos.chdir(pathlib.Path({target!r}).parent)\nopen('outside.txt', 'w')",
        "import os\nos.symlink({target!r}, 'link')\nopen('link', 'w')",
    ],
)
def test_writing_outside_the_scratch_directory_is_refused(scratch, template):
    target = scratch.parent / "outside.txt"
    result = _run(scratch, template.format(target=str(target)))
    assert result.error == "refused"
    assert "SANDBOX-REFUSED: " in result.content
    assert not target.exists()


def test_changing_a_file_outside_is_refused_and_it_stays(scratch):
    target = scratch.parent / "outside.txt"
    target.write_text("kept")
    for code in (
        f"import os\nos.remove({str(target)!r})",
        f"import os\nos.chmod({str(target)!r}, 0o777)",
        f"import os\nos.truncate({str(target)!r}, 0)",
    ):
        assert _run(scratch, code).error == "refused", code
    assert target.read_text() == "kept" and target.stat().st_mode & 0o777 != 0o777


def test_writing_inside_the_scratch_directory_works_and_persists(scratch):
    code = "import os\nos.makedirs('notes', exist_ok=True)\nopen('notes/a.txt', 'w').write('hello')\nprint('done')"
    assert _run(scratch, code) == ToolResult("done\n")
    assert (scratch / "notes" / "a.txt").read_text() == "hello"
    # a later call of the same sandbox sees it; tempfile works, in scratch
    later = "import tempfile\nprint(open('notes/a.txt').read(), tempfile.mkstemp()[1].startswith(os.getcwd()))"
    assert _run(scratch, "import os\n" + later) == ToolResult("hello True\n")


def test_reading_the_standard_library_works(scratch):
    code = "import json, decimal, fractions, statistics, re\nprint(json.dumps([statistics.mean([1, 2, 3])]))"
    assert _run(scratch, code) == ToolResult("[2]\n")


def test_an_exception_is_raised_with_its_traceback(scratch):
    result = _run(scratch, "print('before')\nraise ValueError('boom')")
    assert result.error == "raised"
    assert result.content.startswith("before\n") and result.content.endswith("ValueError: boom")
    assert _run(scratch, "import sys\nsys.exit(3)") == ToolResult(
        "python: the code exited with status 3", error="raised"
    )


def test_the_environment_is_minimal_and_stdin_is_empty(scratch, monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", "leaked")
    code = "import os, sys\nprint(sorted(os.environ), os.environ['HOME'] == os.getcwd(), repr(sys.stdin.read()))"
    result = _run(scratch, code)
    # LC_CTYPE is the child's own: Python coerces the C locale to C.UTF-8
    assert result == ToolResult(f"{['HOME', 'LC_CTYPE', 'PATH', 'TMPDIR']} True ''\n")
    assert os.environ["SANDBOX_TEST_SECRET"] == "leaked"
