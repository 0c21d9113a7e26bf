"""Issue 63 item 3: a run directory is the user's own and its files are never written through a link.

A directory pre-made in shared scratch by another user, holding links (``provenance.json``,
``routing_report.html``) to the victim's own files, once had the run overwrite those files. Now the
claim refuses such a directory naming the links (and one owned by another user), and every writer
refuses a link planted after the claim; in every case the link's target is left as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gspo_megatron.config.schema import CheckpointSection
from gspo_megatron.core.run_dir import METRICS_FILE, RunDirError, drop_records_from_step
from gspo_megatron.run.routing_report import write_routing_report
from gspo_megatron.run.run_dir_owner import LOCK_FILE, claim_run_dir
from gspo_megatron.run.run_log import RunLog

VICTIM_TEXT = "the victim's own work\n"
NOBODY = 65534  # the conventional uid of "nobody"


def _victim(tmp_path: Path, name: str = "victim.txt") -> Path:
    victim = tmp_path / "home" / name
    victim.parent.mkdir(exist_ok=True)
    victim.write_text(VICTIM_TEXT)
    return victim


def _claim(run_dir: Path):
    return claim_run_dir(run_dir, CheckpointSection(resume="false", overwrite=True), "a: 1\n")


def test_run_dir_holding_links_is_refused_naming_them_and_their_targets_are_untouched(tmp_path):
    run_dir = tmp_path / "scratch" / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    provenance, report = _victim(tmp_path, "notes.json"), _victim(tmp_path, "thesis.html")
    (run_dir / "provenance.json").symlink_to(provenance)
    (run_dir / "routing_report.html").symlink_to(report)
    (run_dir / "checkpoints" / "latest.tmp").symlink_to(provenance)  # below the top level too
    with pytest.raises(RunDirError, match="holds symbolic links") as refused:
        _claim(run_dir)
    for name in ("provenance.json", "routing_report.html", "checkpoints/latest.tmp"):
        assert str(run_dir / name) in str(refused.value)
    assert provenance.read_text() == report.read_text() == VICTIM_TEXT
    assert not (run_dir / LOCK_FILE).exists()  # refused before anything was written


def test_links_wandb_makes_in_its_own_directory_are_not_refused(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "wandb" / "run-1").mkdir(parents=True)
    (run_dir / "wandb" / "latest-run").symlink_to("run-1")
    _claim(run_dir).release()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user owns needs root")
def test_run_dir_owned_by_another_user_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chown(run_dir, NOBODY, NOBODY)
    with pytest.raises(RunDirError, match=f"owned by .*uid {NOBODY}.*not by you"):
        _claim(run_dir)
    assert list(run_dir.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making a link another user owns needs root")
def test_run_dir_named_by_another_users_link_is_refused(tmp_path):
    """A link in shared scratch, planted by another user, naming a directory of the victim's own."""
    victims_dir = tmp_path / "home" / "project"
    victims_dir.mkdir(parents=True)
    run_dir = tmp_path / "scratch_run"
    run_dir.symlink_to(victims_dir)
    os.chown(run_dir, NOBODY, NOBODY, follow_symlinks=False)
    with pytest.raises(RunDirError, match=f"the link naming it is owned by .*uid {NOBODY}"):
        _claim(run_dir)
    assert list(victims_dir.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user owns needs root")
def test_run_dir_holding_another_users_entry_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "routing_report.json").write_text("{}")
    os.chown(run_dir / "routing_report.json", NOBODY, NOBODY)
    with pytest.raises(RunDirError, match="entries owned by another user: .*routing_report.json"):
        _claim(run_dir)


def _run_log(run_dir: Path, charts: bool = False) -> RunLog:
    return RunLog(run_dir, 1, tensorboard=False, wandb_project=None, progress=False, config_yaml="", charts=charts)


def _write_config(run_dir: Path) -> None:
    _run_log(run_dir).write_config()


def _open_metrics(run_dir: Path) -> None:
    _run_log(run_dir).close()


def _cut_metrics(run_dir: Path) -> None:
    (run_dir / METRICS_FILE).write_text('{"step": 1}\n{"step": 2}\n')
    drop_records_from_step(run_dir / METRICS_FILE, 2)


def _routing_report(run_dir: Path) -> None:
    (run_dir / METRICS_FILE).write_text('{"step": 1, "reward/mean": 0.5}\n')
    write_routing_report(run_dir, charts=False)


def _reward_curve(run_dir: Path) -> None:
    log = _run_log(run_dir, charts=True)
    log.log_step(1, {"reward/mean": 0.5})
    log.close()


@pytest.mark.parametrize(
    ("planted", "writer"),
    [
        ("provenance.json", _write_config),
        ("config.yaml", _write_config),
        (METRICS_FILE, _open_metrics),
        (f"{METRICS_FILE}.tmp", _cut_metrics),
        ("routing_report.html", _routing_report),
        ("reward_curve.png", _reward_curve),
    ],
)
def test_a_writer_never_follows_a_link_planted_after_the_claim(tmp_path, planted, writer):
    run_dir = tmp_path / "run"
    claim = _claim(run_dir)
    try:
        victim = _victim(tmp_path)
        (run_dir / planted).symlink_to(victim)
        with pytest.raises(RunDirError, match=f"{planted} is a symbolic link"):
            writer(run_dir)
    finally:
        claim.release()
    assert victim.read_text() == VICTIM_TEXT
