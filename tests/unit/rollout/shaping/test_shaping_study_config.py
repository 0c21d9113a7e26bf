"""The shipped shaping study exercises what it claims: GRSP's length clusters are populated by the
warm-started policy's responses, and those responses fit the rollout budget."""

import importlib.util
import json
import random
from pathlib import Path

from omegaconf import OmegaConf

from gspo_megatron.config.compose import compose
from gspo_megatron.config.store import register_configs
from gspo_megatron.rollout.data.tasks import build_task
from gspo_megatron.rollout.data.tokenizer import build_tokenizer
from gspo_megatron.rollout.shaping.segmentation import cluster_counts, keyword_segment_lengths

TOOLS = Path(__file__).resolve().parents[4] / "tools"
register_configs()


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _warm_start_arg(flag):
    args = _tool("shaping_study").WARM_START
    return int(args[args.index(flag) + 1])


def test_warm_started_responses_populate_every_grsp_length_cluster_of_the_shipped_study():
    cfg = OmegaConf.to_object(compose(["+experiment=shaping_from_sft", "shaping=grsp"]))
    assert (_warm_start_arg("--min-digits"), _warm_start_arg("--digits")) == (
        cfg.task.min_digits,
        cfg.task.max_digits,
    ), "the warm start must train on the study's problems"
    tokenizer = build_tokenizer("symbol", model_vocab_size=cfg.model.vocab_size)
    task = build_task(cfg.task, tokenizer)
    verbose_response = _tool("sft_warmstart").verbose_response
    rng = random.Random(0)
    texts = [verbose_response(r, rng, _warm_start_arg("--max-waits")) for r in task.next_batch(200)]
    lengths = [len(tokenizer.encode(t)) + 1 for t in texts]  # + EOS
    assert max(lengths) <= cfg.rollout.max_new_tokens, "warm-started responses would be cut off"
    for edges in (cfg.shaping.grsp.bucket_edges, cfg.shaping.metrics.bucket_edges):
        segments = [
            keyword_segment_lengths(t, n, cfg.shaping.grsp.keywords) for t, n in zip(texts, lengths, strict=True)
        ]
        per_cluster = cluster_counts(segments, edges).sum(0)
        populated = int((per_cluster > 0).sum())
        assert populated == len(edges) + 1, f"clusters {per_cluster.tolist()} for edges {list(edges)}"
        assert bool((per_cluster >= 0.05 * per_cluster.sum()).all()), "a cluster holds < 5% of segments"


def test_the_study_turns_on_dynamic_truncated_rollout_for_step_grpo():
    arms = _tool("shaping_study").ARMS
    assert "rollout.truncated=true" in arms["step_grpo_dtr"] and "shaping=step_grpo" in arms["step_grpo_dtr"]
    cfg = OmegaConf.to_object(compose(["+experiment=shaping_from_sft", *arms["step_grpo_dtr"]]))
    tokenizer = build_tokenizer("symbol", model_vocab_size=cfg.model.vocab_size)
    for text in (cfg.rollout.truncation.probe_suffix, cfg.rollout.truncation.close_thinking):
        assert tokenizer.encode(text)  # the symbol alphabet can express the probe and the closing
    assert cfg.rollout.group_size == 5  # Step-GRPO's group size


def test_every_arm_of_the_study_composes_and_validates_with_enough_evidence():
    """The study's arms (and +experiment=shaping_study) start, and its defaults meet the evidence bar:
    >= 50 RL steps, >= 3 seeds, >= 64 evaluation prompts."""
    from gspo_megatron.config.validate import validate_config

    tool = _tool("shaping_study")
    assert set(tool.ARMS) == {
        "baseline",
        "dtr_only",
        "step_grpo_reward",
        "step_grpo_dtr",
        "step_grpo_dtr_exit_trained",
        "grsp_keyword",
        "grsp_confidence",
    }
    for arm, overrides in tool.ARMS.items():
        cfg = OmegaConf.to_object(compose(["+experiment=shaping_from_sft", *overrides]))
        validate_config(cfg, 1)
        assert cfg.rollout.truncated == ("rollout.truncated=true" in overrides), arm
        assert cfg.trainer.eval_prompts >= 64 and cfg.trainer.steps >= 50
    method = OmegaConf.to_object(compose(["+experiment=shaping_study"]))
    assert method.shaping.name == "step_grpo" and method.rollout.truncated
    assert method.rollout.truncation.train_on_exit_tokens  # the study's finding: the exit must be learned


def _finished_run(run_dir, steps, **provenance):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps + 1)))
    (run_dir / "provenance.json").write_text(json.dumps(provenance))


def test_a_finished_run_is_reused_only_for_the_same_clean_commit(tmp_path):
    """A stored report must come from its commit: a run of other (or uncommitted) code is trained again."""
    reusable_run = _tool("shaping_study").reusable_run
    here = {"commit": "a" * 40, "dirty": False}
    _finished_run(tmp_path / "same", 3, commit="a" * 40, dirty=False)
    _finished_run(tmp_path / "other", 3, commit="b" * 40, dirty=False)
    _finished_run(tmp_path / "dirty", 3, commit="a" * 40, dirty=True)
    _finished_run(tmp_path / "short", 2, commit="a" * 40, dirty=False)
    assert reusable_run(tmp_path / "same", 3, here)
    assert not reusable_run(tmp_path / "other", 3, here)
    assert not reusable_run(tmp_path / "dirty", 3, here)
    assert not reusable_run(tmp_path / "short", 3, here)
    assert not reusable_run(tmp_path / "same", 3, {"commit": "a" * 40, "dirty": True})  # this checkout is dirty


def test_the_confidence_arm_trains_with_the_calibrated_segmentation_and_the_defaults_are_the_stored_calibration():
    tool = _tool("shaping_study")
    overrides = tool.calibrated_overrides({"best": {"window": 3, "threshold": -0.5}})
    cfg = OmegaConf.to_object(compose(["+experiment=shaping_from_sft", *tool.ARMS["grsp_confidence"], *overrides]))
    assert (cfg.shaping.grsp.confidence_window, cfg.shaping.grsp.confidence_threshold) == (3, -0.5)
    stored = json.loads((TOOLS.parent / "reports/shaping_study/confidence_calibration.json").read_text())
    defaults = OmegaConf.to_object(compose(["shaping=grsp"])).shaping.grsp
    assert (defaults.confidence_window, defaults.confidence_threshold) == (
        stored["best"]["window"],
        stored["best"]["threshold"],
    ), "conf/shaping/grsp.yaml's confidence settings must be the study's stored calibration"
    assert stored["commit"] and stored["command"].startswith("python tools/calibrate_confidence_segmentation.py")
