"""The study store (tools/study_reports/store.py) and tools/regenerate_report.py: a stored study's report
rebuilds bit for bit from its store alone; a changed number, a hand-edited stored file and a study without a
store are each found and named."""

import gzip
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import regenerate_report
import store_runs

from gspo_megatron.core.run_dir import JsonlLog
from study_reports.store import RUNS_DIR, STORE_FILE, load_store

REPORTS = Path(__file__).resolve().parents[3] / "reports"
WARM_START = {"weights_sha256": "ab" * 32, "command": "python3 tools/sft_warmstart.py --model small_moe", "threads": 1}


def make_run(path: Path, algorithm: str, seed: int, rewards: list[float], dirty: bool = False) -> Path:
    """A run directory as the trainer writes it: config, provenance, per-step metrics and routing records."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"algorithm:\n  name: {algorithm}\ntrainer:\n  seed: {seed}\n")
    provenance = {"commit": "c0ffee", "dirty": dirty, "command": "python -m gspo_megatron.train --multirun x"}
    (path / "provenance.json").write_text(json.dumps({**provenance, "cpu_threads": 1, "warm_start": WARM_START}))
    with JsonlLog(path / "metrics.jsonl") as log:
        for step, reward in enumerate(rewards, start=1):
            log.append({"step": step, "reward/mean": reward, "loss/clip_frac_token": 0.1 * step})
    with JsonlLog(path / "routing.jsonl") as log:
        for step in range(1, len(rewards) + 1):
            log.append(
                {
                    "step": step,
                    "kind": "update",
                    "changed_frac": [0.2, 0.0],
                    "overlap": [0.9, 1.0],
                    "changed_frac_overall": 0.1,
                    "overlap_overall": 0.95,
                    "experts_changed_per_slot": 0.05,
                    "changed_any_frac": 0.2,
                    "tokens": 10,
                }
            )
    return path


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "multirun"
    make_run(root / "0_grpo_seed1", "grpo", 1, [0.1, 0.3])
    make_run(root / "1_grpo_seed2", "grpo", 2, [0.2, 0.5], dirty=True)
    make_run(root / "2_gspo_seed1", "gspo", 1, [0.2, 0.6])
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def stored_study(sweep: Path, study: Path) -> Path:
    assert store_runs.main([str(sweep), "--study", str(study)]) == 0
    assert regenerate_report.main([str(study)]) == 0
    return study


def rewrite_stored_metrics(study: Path, run: str, edit, keep_manifest: bool = False) -> None:
    """Change one stored run's metrics; with ``keep_manifest`` the manifest's sha256 is left stale."""
    stored = study / RUNS_DIR / run / "metrics.jsonl.gz"
    records = [json.loads(line) for line in gzip.decompress(stored.read_bytes()).decode().splitlines()]
    edit(records)
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    stored.write_bytes(gzip.compress(data, mtime=0))
    if not keep_manifest:
        manifest_path = study / RUNS_DIR / run / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        manifest["files"]["metrics.jsonl.gz"] = hashlib.sha256(data).hexdigest()
        manifest_path.write_text(json.dumps(manifest))


@pytest.mark.slow
def test_the_stored_miniature_regenerates_bit_for_bit(capsys):
    """reports/routing_stability_miniature: its study.json and comparison.json from its store alone."""
    assert regenerate_report.main([str(REPORTS / "routing_stability_miniature"), "--check"]) == 0
    assert "regenerate bit for bit from 8 stored runs" in capsys.readouterr().out


def test_the_stored_shaping_study_regenerates_bit_for_bit(capsys):
    """reports/shaping_study: report.json from its 21 stored runs and the inputs in its store.json."""
    assert regenerate_report.main([str(REPORTS / "shaping_study"), "--check"]) == 0
    assert "report.json regenerate bit for bit from 21 stored runs" in capsys.readouterr().out


def test_the_stored_e1_routing_shape_study_regenerates_bit_for_bit(capsys):
    """reports/e1_routing_shape: report.json (arms, verdicts, per-layer numbers) from its 16 stored runs."""
    assert regenerate_report.main([str(REPORTS / "e1_routing_shape"), "--check"]) == 0
    assert "report.json regenerate bit for bit from 16 stored runs" in capsys.readouterr().out


def test_the_stored_e1_qwen35_shape_study_regenerates_bit_for_bit(capsys):
    """reports/e1_qwen35_shape: report.json (its arms, their verdicts beside E1's stored 48 x 128 and 6 x 32 arms)
    from its 8 stored runs and E1's store."""
    assert regenerate_report.main([str(REPORTS / "e1_qwen35_shape"), "--check"]) == 0
    assert "report.json regenerate bit for bit from 8 stored runs" in capsys.readouterr().out


def test_the_stored_e3_long_response_study_regenerates_bit_for_bit(capsys):
    """reports/e3_long_responses: report.json (arms, the pre-registered tests, the verdict) from its 24 stored runs."""
    assert regenerate_report.main([str(REPORTS / "e3_long_responses"), "--check"]) == 0
    assert "report.json regenerate bit for bit from 24 stored runs" in capsys.readouterr().out


def test_the_stored_e3_qwen35_shape_study_regenerates_bit_for_bit(capsys):
    """reports/e3_qwen35_shape: report.json (E3's arms, tests and verdict on Qwen3.5's routing shape) from its
    22 stored runs."""
    assert regenerate_report.main([str(REPORTS / "e3_qwen35_shape"), "--check"]) == 0
    assert "report.json regenerate bit for bit from 22 stored runs" in capsys.readouterr().out


def test_the_stored_e4_shaping_study_regenerates_bit_for_bit(capsys):
    """reports/e4_shaping: report.json (arms by warm start, noise floors, the exact tests, the verdicts) from its 84
    stored runs."""
    assert regenerate_report.main([str(REPORTS / "e4_shaping"), "--check"]) == 0
    assert "report.json regenerate bit for bit from 84 stored runs" in capsys.readouterr().out


def test_the_stored_e2_off_policy_study_regenerates_bit_for_bit(capsys):
    """reports/e2_off_policy: report.json (arms, the pre-registered tests, the verdict) from its 48 stored runs."""
    assert regenerate_report.main([str(REPORTS / "e2_off_policy"), "--check"]) == 0
    assert "report.json regenerate bit for bit from 48 stored runs" in capsys.readouterr().out


def test_the_stored_e2_qwen35_shape_study_regenerates_bit_for_bit(capsys):
    """reports/e2_qwen35_shape: report.json (E2's arms, tests and verdict rule on Qwen3.5's 4-layer routing shape)
    from its 6 stored runs (a partial study: 2 seeds per arm)."""
    assert regenerate_report.main([str(REPORTS / "e2_qwen35_shape"), "--check"]) == 0
    assert "report.json regenerate bit for bit from 6 stored runs" in capsys.readouterr().out


@pytest.mark.parametrize("study", ["agent_calculator", "agent_lookup"])
def test_the_stored_agent_studies_regenerate_bit_for_bit(study, capsys):
    """reports/agent_*: summary.json from the 3 stored runs and the stored warm-start evaluation."""
    assert regenerate_report.main([str(REPORTS / study), "--check"]) == 0
    assert "summary.json regenerate bit for bit from 3 stored runs" in capsys.readouterr().out


def test_the_stored_async_study_regenerates_bit_for_bit(capsys):
    """reports/async_long_tail: report.json from its 6 stored runs (sync and streaming k = 2, 3 seeds each)."""
    assert regenerate_report.main([str(REPORTS / "async_long_tail"), "--check"]) == 0
    assert "report.json regenerate bit for bit from 6 stored runs" in capsys.readouterr().out


def test_the_stored_second_async_study_regenerates_bit_for_bit(capsys):
    """reports/async_long_tail_lr3e-4: report.json from its 9 stored runs (sync and streaming k = 2 on the embedded
    engine, streaming k = 2 on the live CPU SGLang server, 3 seeds each)."""
    assert regenerate_report.main([str(REPORTS / "async_long_tail_lr3e-4"), "--check"]) == 0
    assert "report.json regenerate bit for bit from 9 stored runs" in capsys.readouterr().out


def test_the_store_keeps_whole_runs_and_a_manifest_of_their_inputs(sweep, tmp_path):
    study = tmp_path / "study"
    assert store_runs.main([str(sweep), "--study", str(study)]) == 0
    index = json.loads((study / STORE_FILE).read_text())
    assert index["runs"] == ["0_grpo_seed1", "1_grpo_seed2", "2_gspo_seed1"] and index["report"] == "routing_study"
    manifest = json.loads((study / RUNS_DIR / "1_grpo_seed2" / "manifest.json").read_text())
    assert manifest["seeds"]["trainer.seed"] == 2 and manifest["cpu_threads"] == 1
    assert manifest["commit"] == "c0ffee" and manifest["clean_tree"] is False  # the dirty run says so
    assert manifest["warm_start_sha256"] == WARM_START["weights_sha256"]
    assert manifest["warm_start_command"] == WARM_START["command"]
    assert manifest["command"].startswith("python -m gspo_megatron.train")
    assert set(manifest["files"]) == {"config.yaml", "metrics.jsonl.gz", "routing.jsonl.gz"}
    loaded = load_store(study)
    assert [str(run.path) for run in loaded.runs] == [f"stored_runs/{name}" for name in index["runs"]]
    original = (sweep / "1_grpo_seed2" / "metrics.jsonl").read_text()
    assert loaded.runs[1].metrics == [json.loads(line) for line in original.splitlines()]
    # the same runs store as the same bytes: re-storing an unchanged study shows no diff
    before = {p: p.read_bytes() for p in study.rglob("*") if p.is_file()}
    assert store_runs.main([str(sweep), "--study", str(study)]) == 0
    assert {p: p.read_bytes() for p in study.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_a_changed_number_in_the_store_is_found_and_named(sweep, tmp_path, capsys):
    study = stored_study(sweep, tmp_path / "study")
    assert regenerate_report.main([str(study), "--check"]) == 0
    capsys.readouterr()

    def last_reward_up(records):
        records[-1]["reward/mean"] += 1e-12  # the smallest change a report could hide by rounding

    rewrite_stored_metrics(study, "2_gspo_seed1", last_reward_up)
    assert regenerate_report.main([str(study), "--check"]) == 1
    err = capsys.readouterr().err
    assert "differences from the stored report" in err and "comparison.json/2/final_reward" in err


def test_a_hand_edited_stored_file_is_refused(sweep, tmp_path, capsys):
    study = tmp_path / "study"
    assert store_runs.main([str(sweep), "--study", str(study)]) == 0
    rewrite_stored_metrics(study, "0_grpo_seed1", lambda records: records.pop(), keep_manifest=True)
    assert regenerate_report.main([str(study), "--check"]) == 2
    err = capsys.readouterr().err
    assert "0_grpo_seed1/metrics.jsonl.gz differs from the sha256 its manifest records" in err


def test_a_study_whose_runs_were_not_stored_is_refused(tmp_path, capsys):
    lost = tmp_path / "routing_stability"  # a report whose per-run data lived in multirun/: its numbers, no store
    lost.mkdir()
    for name in ("study.json", "comparison.json"):
        shutil.copy(REPORTS / "routing_stability_miniature" / name, lost / name)
    assert regenerate_report.main([str(lost), "--check"]) == 2
    err = capsys.readouterr().err
    assert "has no store.json: its runs were not stored" in err and "README.md" in err


def test_a_manifest_of_another_format_is_refused_naming_it(sweep, tmp_path, capsys):
    study = tmp_path / "study"
    assert store_runs.main([str(sweep), "--study", str(study)]) == 0
    (study / RUNS_DIR / "2_gspo_seed1" / "manifest.json").write_text(json.dumps({"seed": 1}))
    assert regenerate_report.main([str(study), "--check"]) == 2
    assert "2_gspo_seed1/manifest.json: not a manifest of this store format" in capsys.readouterr().err
