"""Routing Replay on megatron's RouterReplay: replayed training forwards route exactly as recorded.

After a real optimizer step (large LR, so routing moves), a training forward with replay uses the
recorded old-policy experts for every token (volatility 0); without replay the experts change.
Rollout replay (R3) makes the trainer use exactly the experts given to it, under EP=2 and PP=2.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import FAMILY_TEST_OVERRIDES, fixed_batch, random_hf_state, tiny_family_config

pytestmark = pytest.mark.distributed


def _routing_used(model_chunk):
    """Hooks on every router (dense layers have none): the top-k sets it used, per forward, as sorted indices."""
    used = []

    def hook(module, inputs, output):
        _, routing_map = output
        used.append(routing_map.nonzero()[:, 1].reshape(routing_map.shape[0], -1))

    handles = [
        layer.mlp.router.register_forward_hook(hook)
        for layer in model_chunk.decoder.layers
        if hasattr(layer.mlp, "router")
    ]
    return used, handles


def _setup(layout_kwargs, seed=3, family="qwen3_moe", **overrides):
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.conversion import load_hf_weights
    from gspo_megatron.policy.models.schedule import wrap_for_training
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel
    from gspo_megatron.policy.routing.replay import RoutingReplay

    cfg = tiny_family_config(family, **overrides)
    layout = ParallelLayout(**layout_kwargs).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=11)
    before = RoutingReplay.instance_count()
    model = build_model(cfg, layout)
    replay = RoutingReplay.capture_new_instances(before)
    load_hf_weights(model, cfg, random_hf_state(cfg, seed=seed), mesh)
    ddp = wrap_for_training(model, model.config)
    return cfg, layout, mesh, model, ddp, replay


def _micro_batches(cfg, layout, mesh):
    inputs, targets, weights = fixed_batch(cfg)
    rows = inputs.shape[0] // layout.dp
    sl = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    return [
        MicroBatch(tokens=inputs[sl][i : i + 1], targets=targets[sl][i : i + 1], weights=weights[sl][i : i + 1])
        for i in range(rows)
    ]


def old_policy_replay_worker(
    ctx, use_replay: bool, layout_kwargs: dict | None = None, family: str = "qwen3_moe", overrides: dict | None = None
):
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from gspo_megatron.policy.models.schedule import run_schedule
    from gspo_megatron.policy.routing.volatility import routing_volatility

    cfg, layout, mesh, model, ddp, replay = _setup(
        layout_kwargs or dict(world_size=1), family=family, **(overrides or {})
    )
    mbs = _micro_batches(cfg, layout, mesh)
    biases = _expert_biases(model)
    # 1. old-policy pass records the routing of every micro-batch
    replay.start_recording()
    run_schedule([ddp], mbs, None, forward_only=True)
    old = replay.recorded()
    replay.stop()
    # 2. one real optimizer step with a large learning rate: routing would move
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.05, clip_grad=0.0), [ddp])

    def loss(logits, batch):
        logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch.targets)
        return -(batch.weights * logp).sum() / 48, {}

    ddp.zero_grad_buffer()
    run_schedule([ddp], mbs, loss, forward_only=False)
    optimizer.step()
    # 3. the training forward, with or without replay, observed through router hooks
    used, handles = _routing_used(model)
    before = None
    if use_replay:
        replay.load_targets(old)
        before = replay.before_forward
    ddp.zero_grad_buffer()
    run_schedule([ddp], mbs, loss, forward_only=False, before_forward=before)
    if use_replay:
        replay.assert_fully_consumed()
        replay.stop()
    for handle in handles:
        handle.remove()
    layers = sum(hasattr(layer.mlp, "router") for layer in model.decoder.layers)
    now = [used[i * layers : (i + 1) * layers] for i in range(len(mbs))]
    changed = sum(
        routing_volatility(torch.stack(o, 1).sort(-1).values, torch.stack(n, 1)).changed_count.sum().item()
        for o, n in zip(old, now, strict=True)
    )
    identical = all(
        torch.equal(o_l.sort(-1).values, n_l)
        for o, n in zip(old, now, strict=True)
        for o_l, n_l in zip(o, n, strict=True)
    )
    bias_moved = any(not torch.equal(b0, b1) for b0, b1 in zip(biases, _expert_biases(model), strict=True))
    mesh.destroy()
    return {"changed": changed, "identical": identical, "bias_moved": bias_moved}


def _expert_biases(model) -> list[torch.Tensor]:
    return [b.detach().clone() for name, b in model.named_buffers() if name.endswith("router.expert_bias")]


@pytest.mark.parametrize("family", sorted(FAMILY_TEST_OVERRIDES))
def test_replayed_training_forward_routes_exactly_as_recorded(family):
    (result,) = run_distributed(old_policy_replay_worker, 1, True, None, family)
    assert result["identical"] and result["changed"] == 0


def test_replayed_training_forward_routes_as_recorded_under_context_parallelism():
    """R2 with each CP rank holding half of every sequence: the replay covers exactly its tokens."""
    results = run_distributed(old_policy_replay_worker, 2, True, dict(cp=2, world_size=2))
    assert all(r["identical"] and r["changed"] == 0 for r in results)


# megatron moves the expert bias from the experts' load in the update (finalize_model_grads); a large rate
# makes the biased argmax differ from the recorded choice
MOVING_BIAS = {"expert_bias_update_rate": 0.5}


@pytest.mark.parametrize("use_replay", [True, False], ids=["replayed", "free"])
def test_replay_keeps_the_recorded_experts_when_the_expert_bias_moves(use_replay):
    """GLM-4.5's router: the expert bias picks the experts. Between recording (old policy) and the training
    forward the update moves the bias; R2 replays the recorded set, not the new biased argmax."""
    (result,) = run_distributed(old_policy_replay_worker, 1, use_replay, None, "glm4_moe", MOVING_BIAS)
    assert result["bias_moved"]
    if use_replay:
        assert result["identical"] and result["changed"] == 0
    else:
        assert result["changed"] > 0 and not result["identical"]


@pytest.mark.parametrize("family", sorted(FAMILY_TEST_OVERRIDES))
def test_without_replay_routing_moves_after_an_update(family):
    (result,) = run_distributed(old_policy_replay_worker, 1, False, None, family)
    assert result["changed"] > 0 and not result["identical"]


def rollout_replay_worker(ctx, layout_kwargs):
    """R3: the engine's routed experts (here: a fixed random routing) are what the trainer uses."""
    from gspo_megatron.policy.models.schedule import run_schedule
    from gspo_megatron.policy.routing.replay import rollout_targets

    cfg, layout, mesh, model, ddp, replay = _setup(layout_kwargs)
    mbs = _micro_batches(cfg, layout, mesh)
    generator = torch.Generator().manual_seed(5)
    # an "engine" routing [b, s, layers, k]: k distinct experts per token, all layers MoE
    engine = [
        torch.stack(
            [
                torch.randperm(cfg.num_experts, generator=generator)[: cfg.top_k]
                for _ in range(mb.tokens.numel() * cfg.num_layers)
            ]
        ).reshape(*mb.tokens.shape, cfg.num_layers, cfg.top_k)
        for mb in mbs
    ]
    stage_layers = [layer.layer_number - 1 for layer in model.decoder.layers]
    targets = [
        rollout_targets(r, stage_layers, mesh.tp_rank, layout.tp, layout.use_sequence_parallel, layout.cp, mesh.cp_rank)
        for r in engine
    ]
    used, handles = _routing_used(model)
    replay.load_targets(targets)
    run_schedule([ddp], mbs, None, forward_only=True, before_forward=replay.before_forward)
    replay.assert_fully_consumed()
    replay.stop()
    for handle in handles:
        handle.remove()
    layers = sum(hasattr(layer.mlp, "router") for layer in model.decoder.layers)
    ok = all(
        torch.equal(used[i * layers + j], targets[i][j].sort(-1).values) for i in range(len(mbs)) for j in range(layers)
    )
    mesh.destroy()
    return ok


@pytest.mark.parametrize(
    "layout",
    [dict(world_size=1), dict(ep=2, world_size=2), dict(pp=2, world_size=2), dict(cp=2, ep=2, world_size=2)],
    ids=["one_rank", "ep2", "pp2", "cp2_ep2"],
)
def test_rollout_replay_uses_the_engine_routing(layout):
    assert all(run_distributed(rollout_replay_worker, layout["world_size"], layout))


def replay_keeps_router_learning_worker(ctx, source: str):
    """R2 (``recorded``: the routing recorded before a large-LR step) or R3 (``engine``: a routing
    that puts each token's live lowest-scoring expert among its k) replayed in a training forward."""
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from gspo_megatron.policy.models.schedule import run_schedule

    cfg, layout, mesh, model, ddp, replay = _setup(dict(world_size=1))
    mbs = _micro_batches(cfg, layout, mesh)
    routers = [layer.mlp.router for layer in model.decoder.layers]

    def loss(logits, batch):
        logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch.targets)
        return -(batch.weights * logp).sum() / 48, {}

    live_inputs, handles = [], []
    for router in routers:  # what each router saw, to recompute its live dense logits
        handles.append(router.register_forward_hook(lambda m, i, o: live_inputs.append((m, i[0].detach(), o[0]))))
    if source == "recorded":
        replay.start_recording()
        run_schedule([ddp], mbs, None, forward_only=True)
        targets = replay.recorded()
        replay.stop()
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.05, clip_grad=0.0), [ddp])
        ddp.zero_grad_buffer()
        run_schedule([ddp], mbs, loss, forward_only=False)
        optimizer.step()
    else:
        live_inputs.clear()
        run_schedule([ddp], mbs, None, forward_only=True)
        targets = []
        for index in range(len(mbs)):
            per_layer = []
            for module, hidden, _ in live_inputs[index * len(routers) : (index + 1) * len(routers)]:
                logits = hidden.reshape(-1, hidden.shape[-1]).float() @ module.weight.float().t()
                order = logits.argsort(dim=-1, descending=True)
                per_layer.append(torch.cat([order[:, : cfg.top_k - 1], order[:, -1:]], dim=-1))  # + live argmin
            targets.append(per_layer)
    live_inputs.clear()
    replay.load_targets(targets)
    ddp.zero_grad_buffer()
    run_schedule([ddp], mbs, loss, forward_only=False, before_forward=replay.before_forward)
    replay.assert_fully_consumed()
    replay.stop()
    for handle in handles:
        handle.remove()

    outside_topk, gate_errors = 0, []
    for index, (module, hidden, probs) in enumerate(live_inputs):
        replayed = targets[index // len(routers)][index % len(routers)]
        logits = hidden.reshape(-1, hidden.shape[-1]).float() @ module.weight.float().t()
        live_topk = logits.topk(cfg.top_k, dim=-1).indices
        outside = ~(replayed.unsqueeze(-1) == live_topk.unsqueeze(-2)).any(-1)  # [tokens, k]
        outside_topk += int(outside.sum())
        # Qwen3 gate: softmax over the replayed experts' *live* logits (not post-top-k zeros)
        expected = torch.softmax(logits.gather(1, replayed), dim=-1)
        gate_errors.append(float((probs.detach().float().gather(1, replayed) - expected).abs().max()))
    grads = [float(router.weight.main_grad.abs().sum()) for router in routers]
    mesh.destroy()
    return {"outside_topk": outside_topk, "gate_error": max(gate_errors), "router_grads": grads}


@pytest.mark.parametrize("source", ["recorded", "engine"], ids=["R2_old_policy", "R3_rollout"])
def test_replay_keeps_router_learning(source):
    """Under R2 and R3 the routers get gradient, and a replayed expert outside the live top-k takes its
    gate weight from the live dense scores (the failure elsewhere: gathering from post-top-k zeros)."""
    (result,) = run_distributed(replay_keeps_router_learning_worker, 1, source)
    assert result["outside_topk"] > 0  # not vacuous: some replayed experts are not what the router picks now
    assert result["gate_error"] < 1e-5
    assert all(grad > 0 for grad in result["router_grads"]), result["router_grads"]
