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

Under pytest-xdist (CI's main leg: ``-n 2 --dist loadgroup --no-loadscope-reorder``, issue 65) each worker
is a session of its own:
- every test gets an ``xdist_group``: its tier where the tier shares a session fixture (``SHARED_TIERS``:
  one live SGLang server, one contract venv per run, and the live tier's file order kept), else its module,
  so a module-scoped fixture (a shared training run) is still computed once and a file runs in its order;
  without the reorder each worker takes the groups in collection order, a subsequence of a serial run's;
- no worker starts mypy in the background: the worker that draws its test runs it in the foreground,
  while the other worker keeps the second core busy (the background start was for the idle core).

The order the tests run in (``_run_order``; a stable sort, so files and tests otherwise keep theirs):
- the SGLang tiers after the distributed and e2e tiers (``TIERS_BEFORE_SGLANG``): CI's set-up makes their
  venv in the background meanwhile (``tests/sglang_venv_setup.py``);
- the unit tier's two longest modules (``LONG_MODULES_FIRST``: the benchmarks' smoke runs, about 140 s in
  CI, and mypy, about 70 s) before its short ones: with each worker taking the next group when it runs
  low, a long group last in the queue ran on one worker while the other had nothing left (a simulation
  of CI's junit under xdist's scheduling: the workers' ends 1433/1471 s apart -> 1454/1449 s).
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
# tiers whose tests share a session-scoped fixture: one xdist group each, so one worker holds it
SHARED_TIERS = ("contract", "live_sglang")
SGLANG_TIERS = ("contract", "live_sglang")
# several minutes of work on CI's two workers: long enough for the background set-up of the SGLang venv
TIERS_BEFORE_SGLANG = ("distributed", "e2e")
LONG_MODULES_FIRST = ("unit/tools/test_bench_smoke.py", "unit/test_static_checks.py")


# tryfirst: the tier's slow mark must be set before pytest's own hook applies `-m "not slow"`
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        tier = _tier(item)
        if tier in SLOW_TIERS or any(marker in item.keywords for marker in SLOW_TIERS):
            item.add_marker(pytest.mark.slow)
        if config.pluginmanager.hasplugin("xdist"):  # the mark is xdist's: registered only where it is installed
            item.add_marker(pytest.mark.xdist_group(_xdist_group(item, tier)))
    items.sort(key=_run_order)  # stable: each tier's files and tests keep their order


def _tier(item: pytest.Item) -> str:
    return item.path.resolve().relative_to(TESTS).parts[0]


def _run_order(item: pytest.Item) -> tuple[int, int]:
    """(the tier's place: before the SGLang tiers, the SGLang tiers, the rest, unit last as collected; the
    module's place in ``LONG_MODULES_FIRST``, or after them)."""
    tier = _tier(item)
    tier_rank = 0 if tier in TIERS_BEFORE_SGLANG else 1 if tier in SGLANG_TIERS else 3 if tier == "unit" else 2
    module = item.path.resolve().relative_to(TESTS).as_posix()
    return tier_rank, LONG_MODULES_FIRST.index(module) if module in LONG_MODULES_FIRST else len(LONG_MODULES_FIRST)


def _xdist_group(item: pytest.Item, tier: str) -> str:
    """The unit one xdist worker runs whole, in order: a shared tier, else the test's module."""
    return tier if tier in SHARED_TIERS else str(item.path.resolve().relative_to(TESTS).with_suffix(""))


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")  # set by xdist on its workers only


def pytest_collection_finish(session):
    config = session.config
    if (
        any(item.name == MYPY_TEST for item in session.items)
        and not config.option.collectonly
        and not _is_xdist_worker(config)
    ):
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
