"""A user's reward module that fails at import fails start-up with a message naming it (issue 63)."""

from __future__ import annotations

import pytest

from gspo_megatron.rollout.rewards import resolve_reward


def _user_module(tmp_path, monkeypatch, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(source + "\n\ndef score(response, record):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"import:{name}:score"


def test_a_module_that_exits_at_import_is_named_with_its_code(tmp_path, monkeypatch):
    """sys.exit(3) raises SystemExit, a BaseException: it used to end the run with rc 3 and no message."""
    spec = _user_module(tmp_path, monkeypatch, "exits_at_import_63", "import sys\nsys.exit(3)")
    message = r"module 'exits_at_import_63' exited while being imported \(SystemExit, code 3\)"
    with pytest.raises(ValueError, match=message):
        resolve_reward(spec)


def test_a_module_that_raises_at_import_is_named_with_its_exception(tmp_path, monkeypatch):
    spec = _user_module(tmp_path, monkeypatch, "raises_at_import_63", "raise RuntimeError('no GPU here')")
    with pytest.raises(ValueError, match=r"module 'raises_at_import_63' raised RuntimeError: no GPU here") as caught:
        resolve_reward(spec)
    assert isinstance(caught.value.__cause__, RuntimeError)  # the module's traceback is kept
