"""The frozen reference model: its routers never record or replay, whatever the policy's replay does.

Megatron keeps RouterReplay instances in one process-global list; a second model must neither add
to it nor consume the policy's recorded (R2) or engine (R3) routing. Checked on one rank and PP=2,
and with the reference's weights in host memory between passes (``trainer.reference_offload``) on
PP=2 and EP=2 (the grouped experts' shared storages kept).
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import fixed_batch, random_hf_state, tiny_test_config

pytestmark = pytest.mark.distributed


def reference_worker(ctx, layout_kwargs, offload):
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.loss_heads import LogProbHead
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.conversion import load_hf_weights
    from gspo_megatron.policy.models.grouped_experts import stacked_weights
    from gspo_megatron.policy.models.schedule import run_schedule
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel
    from gspo_megatron.policy.reference import ReferenceModel
    from gspo_megatron.policy.routing.replay import RoutingReplay, rollout_targets

    cfg = tiny_test_config()
    layout = ParallelLayout(**layout_kwargs).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=11)
    state = random_hf_state(cfg, seed=3)
    before = RoutingReplay.instance_count()
    policy = build_model(cfg, layout)
    replay = RoutingReplay.capture_new_instances(before)
    load_hf_weights(policy, cfg, state, mesh)
    count_with_policy = RoutingReplay.instance_count()
    reference_chunk = build_model(cfg, layout, routing_replay=False, initialize=False)
    load_hf_weights(reference_chunk, cfg, state, mesh)
    reference = ReferenceModel(
        [reference_chunk], mesh.tp_group, 1.0, None, row_parts_group=mesh.row_parts_group, offload=offload
    )
    result = {
        "instances_added_by_reference": RoutingReplay.instance_count() - count_with_policy,
        "reference_routers_with_replay": sum(
            getattr(layer.mlp, "router", None) is not None and layer.mlp.router.router_replay is not None
            for layer in reference_chunk.decoder.layers
        ),
    }

    inputs, targets, _ = fixed_batch(cfg)
    mbs = [
        MicroBatch(tokens=inputs[i : i + 2], targets=targets[i : i + 2], rows=torch.arange(i, i + 2)) for i in (0, 2)
    ]
    head = LogProbHead(mesh.tp_group, 1.0)

    def policy_log_probs(before_forward=None):
        outs = run_schedule([policy], mbs, head, forward_only=True, before_forward=before_forward)
        return [o.log_probs for o in outs]

    free = policy_log_probs()
    # R2: the reference forward runs while the policy records; only the policy's forwards are recorded
    replay.start_recording()
    reference.log_probs(mbs)
    policy_log_probs()
    ref = reference.log_probs(mbs)
    recorded = replay.recorded()
    replay.stop()
    result["recorded_forwards"] = len(recorded)
    result["ref_equals_free_policy"] = all(
        # strict=False: no log-probs on earlier pipeline stages
        torch.equal(r, f)
        for r, f in zip(ref, free, strict=False)
    )
    # R3: engine routing queued for the policy; the reference forward neither consumes nor uses it
    generator = torch.Generator().manual_seed(5)
    stage_layers = [layer.layer_number - 1 for layer in policy.decoder.layers]
    forced = [
        rollout_targets(
            torch.stack(
                [
                    torch.randperm(cfg.num_experts, generator=generator)[: cfg.top_k]
                    for _ in range(mb.tokens.numel() * cfg.num_layers)
                ]
            ).reshape(*mb.tokens.shape, cfg.num_layers, cfg.top_k),
            stage_layers,
            mesh.tp_rank,
            layout.tp,
            layout.use_sequence_parallel,
        )
        for mb in mbs
    ]
    replay.load_targets(forced)
    ref = reference.log_probs(mbs)
    replayed = policy_log_probs(replay.before_forward)
    replay.assert_fully_consumed()  # raises if the reference had taken any of the targets
    replay.stop()
    result["r3_ref_equals_free_policy"] = all(
        # strict=False: no log-probs on earlier pipeline stages
        torch.equal(r, f)
        for r, f in zip(ref, free, strict=False)
    )
    result["r3_policy_moved"] = (
        any(not torch.equal(r, f) for r, f in zip(replayed, free, strict=True)) if free else True
    )
    result["has_outputs"] = bool(free) == bool(ref)
    if offload:  # between passes every weight lies in the host buffers; each expert projection in one run
        host = {flat.untyped_storage().data_ptr() for flat in reference.host_weights.host.values()}
        result["weights_on_host"] = all(p.untyped_storage().data_ptr() in host for p in reference_chunk.parameters())
        result["host_bytes"] = reference.host_weights.nbytes
        result["param_bytes"] = sum(p.numel() * p.element_size() for p in reference_chunk.parameters())
        experts = [layer.mlp.experts.local_experts for layer in reference_chunk.decoder.layers]
        result["expert_projections_as_views"] = all(
            stacked_weights(tuple(e.linear_fc1.weight for e in local)).untyped_storage().data_ptr()
            == local[0].linear_fc1.weight.untyped_storage().data_ptr()
            for local in experts
            if len(local) > 1
        )
    mesh.destroy()
    return result


@pytest.mark.parametrize(
    "layout, offload",
    [
        (dict(world_size=1), False),
        (dict(pp=2, world_size=2), False),
        (dict(pp=2, world_size=2), True),
        (dict(ep=2, world_size=2), True),
    ],
    ids=["one_rank", "pp2", "pp2_offload", "ep2_offload"],
)
def test_reference_routers_never_record_or_replay(layout, offload):
    for result in run_distributed(reference_worker, layout["world_size"], layout, offload):
        assert result["instances_added_by_reference"] == 0 and result["reference_routers_with_replay"] == 0
        assert result["recorded_forwards"] == 2  # the policy's two micro-batches, nothing from the reference
        # the reference's log-probs equal the policy's own free forward, bit for bit
        assert result["ref_equals_free_policy"] and result["r3_ref_equals_free_policy"]
        assert result["r3_policy_moved"] and result["has_outputs"]
        if offload:
            assert result["weights_on_host"] and result["expert_projections_as_views"]
            assert result["host_bytes"] == result["param_bytes"]
