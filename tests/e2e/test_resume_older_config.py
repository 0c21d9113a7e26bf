"""A run directory written before a config key was renamed resumes after it (``core/config_migrations.py``):
the checkpoint's config -- the flat algorithm section commit 1cd8a48 wrote -- is compared with today's
under the new names, and the resumed run continues exactly where the uninterrupted one goes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from gspo_megatron.testing.distributed import DistributedRunError, run_distributed
from gspo_megatron.testing.train_runs import FAST, read_metrics, train_worker, without_time

OLDER = Path(__file__).with_name("data") / "config_1cd8a48_flat_algorithm.yaml"
# the fixture's overrides in today's names (FAST + trainer.stop_after_steps=1 ... in its header)
RUN = [*FAST, "algorithm=grpo_routing_replay", "algorithm.loss.entropy_coef=0.01"]


def _as_written_by_1cd8a48(run_dir: Path) -> None:
    """The checkpoint's config, and the run directory's, as the code before the rename wrote them."""
    older = OLDER.read_text().replace("RUN_DIR", str(run_dir))
    (checkpoint,) = (run_dir / "checkpoints").glob("step_*")
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    assert yaml.safe_load(state["config"])["algorithm"]["loss"]["entropy_coef"] == 0.01  # today's layout
    state["config"] = older
    torch.save(state, checkpoint / "trainer_state.pt")
    (run_dir / "config.yaml").write_text(older)


def test_a_checkpoint_with_the_flat_algorithm_config_resumes_exactly(tmp_path):
    (full,) = run_distributed(train_worker, 1, RUN, str(tmp_path / "full"), timeout=600)
    resumed = tmp_path / "resumed"
    run_distributed(train_worker, 1, [*RUN, "trainer.stop_after_steps=1"], str(resumed), timeout=600)
    _as_written_by_1cd8a48(resumed)
    run_distributed(train_worker, 1, [*RUN, "checkpoint.resume=true"], str(resumed), timeout=600)
    assert without_time(read_metrics(resumed))[-1] == without_time(full)[-1]
    assert [m["step"] for m in read_metrics(resumed)] == [1, 2]
    written = yaml.safe_load((resumed / "config.yaml").read_text())  # rewritten by today's code
    assert written["routing"]["replay"] == "old_policy" and "routing_replay" not in written["algorithm"]


def test_a_value_changed_across_the_rename_is_refused_by_its_new_name(tmp_path):
    """Without the migration the old key would be "gone" and the new one "added" -- a schema change, accepted."""
    run_distributed(train_worker, 1, [*RUN, "trainer.stop_after_steps=1"], str(tmp_path), timeout=600)
    _as_written_by_1cd8a48(tmp_path)
    changed = [*RUN, "algorithm.loss.entropy_coef=0.02", "checkpoint.resume=true"]
    with pytest.raises(DistributedRunError, match=r"algorithm.loss.entropy_coef: 0.01 -> 0.02"):
        run_distributed(train_worker, 1, changed, str(tmp_path), timeout=600)
