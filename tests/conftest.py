"""Test tiers: unit (default), distributed (gloo ranks on CPU), e2e (tiny training runs), faults,
gpu, contract (SGLang's own code, in its venv), live_sglang (a real SGLang server on CPU).

The fast tier is ``python3 -m pytest -m "not slow"``: every tier that starts processes (distributed,
e2e, faults, gpu, contract, live_sglang) is ``slow`` here, and so are the unit tests marked ``slow`` one by one
(a spawned rank, a subprocess, mypy, or seconds of work). GPU tests are skipped without CUDA. Every
test gets a fixed seed and a single intra-op thread so results do not depend on what else shares
the 2-core machine.

mypy (``tests/unit/test_static_checks.py``, ~50 s on a cold cache) starts in the background when the
session's tests are collected, on the core the single-threaded tests leave idle; its test waits
for it and reads its findings.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
# tools/ on the import path: the planner (tools/planning/) and the study reports (tools/study_reports/) are
# packages the tools import as siblings, and their tests import them the same way
TOOLS = str(TESTS.parent / "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)
MYPY_TEST = "test_mypy_finds_nothing"
_mypy = pytest.StashKey[tuple[subprocess.Popen, Path]]()
SLOW_TIERS = ("distributed", "e2e", "faults", "gpu", "contract", "live_sglang")


# tryfirst: the tier's slow mark must be set before pytest's own hook applies `-m "not slow"`
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        tier = item.path.resolve().relative_to(TESTS).parts[0]
        if tier in SLOW_TIERS or any(marker in item.keywords for marker in SLOW_TIERS):
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session):
    if any(item.name == MYPY_TEST for item in session.items) and not session.config.option.collectonly:
        output = Path(tempfile.mkstemp(prefix="mypy-", suffix=".log")[1])
        with output.open("w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "mypy"], cwd=TESTS.parent, stdout=log, stderr=subprocess.STDOUT
            )
        session.config.stash[_mypy] = (process, output)


def pytest_sessionfinish(session):
    started = session.config.stash.get(_mypy, None)
    if started is not None:
        process, output = started
        if process.poll() is None:  # the session ended before the test read it (-x, Ctrl-C)
            process.kill()
        process.wait()
        output.unlink(missing_ok=True)


@pytest.fixture
def background_mypy(request) -> tuple[subprocess.Popen, Path] | None:
    """The mypy process started when the tests were collected, and its output file (None if not started)."""
    return request.config.stash.get(_mypy, None)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
