"""A pp=2 gloo trainer syncs into the real CPU server through two sender groups (issue 44, item 1).

Rank 0 (the driver, stage 0) sends the embedding and the first layer over ``<group>``; rank 1 (stage 1)
sends the second layer, the final norm and the head over ``<group>_stage1``, each with its own HTTP
client; the server joins both groups. Other weights change the greedy outputs, the checkpoint's
weights restore them exactly; a sync whose stage-1 group the server no longer has is refused in that
group and leaves the server on the version it had; the next sync forms the group again.
"""

from __future__ import annotations

import httpx
import pytest
from support.live_server import LIVE_KEY_ENV, live_config
from test_live_engine import GREEDY, PROMPTS, TINY, greedy_outputs, hf_weights

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import random_hf_state

pytestmark = pytest.mark.distributed


def pp2_sync_worker(ctx, config_values: dict) -> dict:
    from functools import partial

    from gspo_megatron.loop.build import stage_position
    from gspo_megatron.loop.weight_sync import DriverWeightSync, FollowerWeightSync
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.conversion import export_hf_tensors, load_hf_weights
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel
    from gspo_megatron.rollout.sglang.engine import SGLangEngine
    from gspo_megatron.rollout.sglang.stage_turns import StageTurns

    layout = ParallelLayout(pp=2, world_size=2).validate(TINY)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout)
    model = build_model(TINY, layout, layer_spec="portable")
    config = live_config(**config_values)
    turns = StageTurns(partial(export_hf_tensors, model, TINY, mesh, own_stage_only=True), stage_position(mesh), config)
    engine = SGLangEngine(config) if mesh.is_driver else None
    export = partial(export_hf_tensors, model, TINY, mesh)
    weights = (
        DriverWeightSync(export, engine.update_weights, mesh.device, turns)
        if engine is not None
        else FollowerWeightSync(export, mesh.device, turns)
    )
    url = config.urls[0]
    seen: dict = {"outcomes": [], "outputs": [], "versions": []}

    def sync(seed: int, version: int) -> None:
        load_hf_weights(model, TINY, random_hf_state(TINY, seed=seed), mesh)
        try:
            weights.sync(version)
            seen["outcomes"].append("ok")
        except Exception as error:  # noqa: BLE001 - compared across ranks by the test
            seen["outcomes"].append(f"{type(error).__name__}: {error}")
        if engine is not None:
            seen["outputs"].append(greedy_outputs(engine))
            (sample,) = engine.generate([PROMPTS[0]], GREEDY)[0]  # meta_info.weight_version: the server's
            seen["versions"].append(sample.weight_version)

    try:
        if engine is not None:
            seen["before"] = greedy_outputs(engine)
        sync(seed=1, version=11)  # other weights
        sync(seed=0, version=12)  # the checkpoint's
        if engine is not None:  # the server loses stage 1's group: its buckets are refused
            body = {"group_name": config.weight_sync_group_name + "_stage1"}
            headers = engine.api_key.header()  # the servers answer to the run's key only
            httpx.post(url + "/destroy_weights_update_group", json=body, headers=headers, trust_env=False, timeout=60)
        sync(seed=1, version=13)
        sync(seed=0, version=14)  # stage 1 forms its group again
        seen["sent"] = list(turns.sent_names)
    finally:
        turns.close()
        if engine is not None:
            engine.shutdown()
        mesh.destroy()
    return seen


def test_a_pp2_trainer_syncs_through_two_sender_groups_and_a_refused_group_moves_no_server(live_engine, tmp_path):
    values = dict(
        mode="attach",
        urls=live_engine.server_urls,
        model_path=live_engine.config.model_path,
        disk_sync_dir=str(tmp_path / "disk_sync"),
        weight_sync_group_name="live_pp2",
        weight_senders="per_stage",
        fallback_to_disk=False,  # a failure must show, not be papered over by the disk path
        weight_bucket_bytes=256 * 1024,  # several buckets per stage
    )
    driver, stage1 = run_distributed(pp2_sync_worker, 2, values, timeout=900)
    print(f"live pp2: outcomes {driver['outcomes']}, server versions {driver['versions']}")
    assert driver["outcomes"][:2] == stage1["outcomes"][:2] == ["ok", "ok"]
    assert driver["outputs"][0] != driver["before"]  # stage 0's and stage 1's new weights arrived
    assert driver["outputs"][1] == driver["before"]  # and the checkpoint's restore the outputs exactly
    assert driver["versions"][:2] == [11, 12]
    # refused in stage 1's group: an error on both ranks, the server still on version 12
    assert "pipeline stage 1" in driver["outcomes"][2] and "live_pp2_stage1" in driver["outcomes"][2]
    assert stage1["outcomes"][2].startswith("WeightSyncFailed")
    assert driver["versions"][2] == 12
    assert driver["outcomes"][3] == stage1["outcomes"][3] == "ok" and driver["versions"][3] == 14
    assert driver["outputs"][3] == driver["before"]
    names = set(stage1["sent"])
    last = TINY.num_layers - 1
    assert {"lm_head.weight", "model.norm.weight"} <= names
    assert all(n.startswith(f"model.layers.{last}.") for n in names - {"lm_head.weight", "model.norm.weight"})


def test_a_pp2_training_run_syncs_every_step_through_its_stage_senders(live_engine, attach, tmp_path):
    """The trainer builds the turns on every rank (``loop/build.py:stage_turns``) and syncs each step's
    policy through both groups: the engine's log-probs stay those of the trainer's weights. The trainer
    starts from its own seeded init, not the server's checkpoint, so a stage whose layers did not arrive
    would leave the server on other weights: a large mismatch."""
    from gspo_megatron.testing.train_runs import TINY_JOB, train_worker

    (url,) = live_engine.server_urls
    overrides = [
        "rollout=sglang",
        *TINY_JOB,
        "parallel.pp=2",
        "trainer.steps=3",
        "trainer.eval_every=0",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.charts=false",
        "optimizer.lr=3e-3",
        "rollout.sglang.mode=attach",
        f"rollout.sglang.api_key_env={LIVE_KEY_ENV}",
        f"rollout.sglang.urls=[{url}]",
        f"rollout.sglang.model_path={live_engine.config.model_path}",
        f"rollout.sglang.disk_sync_dir={tmp_path / 'disk_sync'}",
        "rollout.sglang.weight_sync=distributed",
        "rollout.sglang.weight_sync_backend=gloo",
        "rollout.sglang.weight_sync_group_name=live_pp2_training",
        "rollout.sglang.fallback_to_disk=false",
        "rollout.sglang.request_timeout_s=600",
    ]
    try:
        metrics, _ = run_distributed(train_worker, 2, overrides, str(tmp_path), timeout=840)
    finally:  # the session's server goes back to the checkpoint's weights for the tests after this one
        attach(weight_sync="disk").update_weights(hf_weights(seed=0), version=100)
    mismatch = [m["mismatch/abs_log_prob_diff_mean"] for m in metrics]
    print(f"live pp2 training: engine vs trainer |log p| mean per step {mismatch}")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(value < 0.05 for value in mismatch), mismatch
