"""Live tier: a REAL SGLang 0.5.23 server on CPU, driven by the project's own ``SGLangEngine``.

The server runs in its own venv (``.venv-sglang``, made by ``launch/setup_sglang.sh``, which
``launch/setup_tests.sh`` starts in the background: the tier waits for it, ``tests/sglang_venv_setup.py``)
through ``launch/sglang_cpu/launch_server.py`` (the CPU workarounds); the tests, the engine and the trainer
run in this interpreter. Where the venv is absent, an interpreter that imports SGLang itself serves (a machine
with a real SGLang install); with neither the tier FAILS, so CI can never pass by silently skipping it.
``GSPO_SKIP_SGLANG=1`` skips it (where SGLang is intentionally absent; ``launch/setup_tests.sh`` then makes no
venv either).

One server per session (start-up takes 1-2.5 minutes on 2 loaded cores): ``live_engine`` owns it in
launch mode; attach-mode engines and the training run attach to its URL. Every test that changes the
server's weights puts the checkpoint's weights back before it ends (``test_live_engine.hf_weights(seed=0)``;
the training runs of ``test_live_training.py``, last in file order, are the exceptions).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.live_server import LIVE_DIR, launch_live_server, live_config
from support.tiny_checkpoint import write_tiny_checkpoint

from gspo_megatron.rollout.sglang.engine import SGLangEngine


def pytest_collection_modifyitems(config, items):
    for item in items:
        if LIVE_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.live_sglang)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("live_sglang") / "tiny_hf")


@pytest.fixture(scope="session")
def live_engine(tiny_checkpoint, tmp_path_factory) -> Iterator[SGLangEngine]:
    """The session's server, launched by the project's engine (launch mode) and stopped at the end."""
    work = tmp_path_factory.mktemp("live_server")
    started = time.monotonic()
    engine = launch_live_server(tiny_checkpoint, work, "live_launch")
    print(f"\nlive: SGLang server {engine.server_urls[0]} started in {time.monotonic() - started:.0f}s")
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture
def attach(live_engine, tiny_checkpoint, tmp_path) -> Iterator[Callable[..., SGLangEngine]]:
    """Engines attached to the session's server (attach mode never stops it), shut down after the test."""
    engines: list[SGLangEngine] = []

    def make(**overrides) -> SGLangEngine:
        values: dict = dict(
            mode="attach",
            urls=live_engine.server_urls,
            model_path=str(tiny_checkpoint),
            disk_sync_dir=str(tmp_path / "disk_sync"),
            weight_sync_group_name=f"live_attach_{len(engines)}",
        )
        engines.append(SGLangEngine(live_config(**{**values, **overrides})))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()
