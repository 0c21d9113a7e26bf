"""megatron's distributed optimizer, as the trainer pairs it (``optimizer.distributed``), on gloo ranks.

The pairing is built with the project's own functions (``use_distributed_optimizer`` ->
``wrap_for_training`` -> ``build_optimizer``), on 2 data-parallel ranks, and stepped 3 times next to
the plain optimizer from the same weights and batch: the weights agree to fp32 rounding, each
rank's Adam state is measured from the tensors torch allocated, and the two ranks' shards add up to
the plain optimizer's (replicated) state.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import fixed_batch, random_hf_state, tiny_test_config

pytestmark = pytest.mark.distributed

STEPS = 3


def adam_state_bytes(optimizer) -> int:
    """Bytes of the Adam moments (and fp32 main weights of a bf16 model) this rank holds."""
    total = 0
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in part.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
    return total


def full_adam_moments(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's Adam moments as whole tensors: this rank's shard written at its place in the
    flattened parameter, zeros elsewhere (summing the ranks' results gives the whole moments)."""
    moments = {}
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    for name, param in model.named_parameters():
        whole = {key: torch.zeros(param.numel()) for key in ("exp_avg", "exp_avg_sq")}
        # the part whose shard holds some of this parameter (megatron maps only owned parameters)
        part = next((p for p in parts if param in p.model_param_gbuf_map), None)
        if part is not None:
            owned = part._get_model_param_range_map(param)["param"]
            shard = part._get_main_param_and_optimizer_states(param)
            for key in whole:
                whole[key][owned.start : owned.end] = shard[key].detach().float()
        moments[name] = whole
    return moments


def train_steps_worker(
    ctx,
    distributed: str,
    dtype: str = "float32",
    checkpoint_dir: str | None = None,
    cp: int = 1,
    cpu_offload: bool = False,
    offload_fraction: float = 1.0,
    precision_aware: bool = False,
) -> dict:
    from megatron.core import tensor_parallel

    from gspo_megatron.policy.config import OptimizerSection, use_distributed_optimizer
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.conversion import export_hf_state_dict, load_hf_weights
    from gspo_megatron.policy.models.schedule import run_schedule, wrap_for_training
    from gspo_megatron.policy.optimizer import build_optimizer
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    cfg = tiny_test_config()
    layout = ParallelLayout(cp=cp, world_size=ctx.world_size).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=11)
    model = build_model(cfg, layout, params_dtype=getattr(torch, dtype))
    load_hf_weights(model, cfg, random_hf_state(cfg, seed=3), mesh)
    section = OptimizerSection(
        lr=0.01,
        weight_decay=0.1,
        warmup_steps=0,
        decay_style="constant",
        distributed=distributed,
        cpu_offload=cpu_offload,
        offload_fraction=offload_fraction,
        precision_aware=precision_aware,
    )
    ddp = wrap_for_training(
        model, model.config, use_distributed_optimizer=use_distributed_optimizer(section.distributed, layout)
    )
    optimizer, scheduler = build_optimizer(ddp, section, total_updates=STEPS)
    resumed = {}
    if checkpoint_dir is not None and ctx.world_size == 1:  # resume what 2 ranks saved
        from gspo_megatron.policy.checkpoint.store import latest_checkpoint, load_checkpoint

        load_checkpoint(latest_checkpoint(checkpoint_dir), model, optimizer)
        resumed["moments"] = full_adam_moments(model, optimizer)
    inputs, targets, weights = fixed_batch(cfg)
    rows = inputs.shape[0] // layout.dp  # data-parallel ranks split the rows, run_schedule the sequences (CP)
    mine = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    batch = [MicroBatch(tokens=inputs[mine], targets=targets[mine], weights=weights[mine])]

    def loss(logits, mb):
        logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), mb.targets)
        return -(mb.weights * logp).sum() / weights.sum(), {}

    grad_norms = []
    for _ in range(1 if resumed else STEPS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        run_schedule(ddp, batch, loss, forward_only=False)
        stepped, grad_norm, _ = optimizer.step()
        scheduler.step(1)
        assert stepped
        grad_norms.append(grad_norm)
    if resumed:  # one step after the resume: every parameter's Adam step count
        resumed["adam_steps"] = [
            state["step"].item()
            for part in getattr(optimizer, "chained_optimizers", [optimizer])
            for state in part.optimizer.state.values()
        ]
        return resumed
    weights_after = {k: v.float() for k, v in export_hf_state_dict(model, cfg, mesh).items()}
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    saved = {}
    if checkpoint_dir is not None:
        from gspo_megatron.policy.checkpoint.store import save_checkpoint

        save_checkpoint(checkpoint_dir, STEPS, model, optimizer, {}, keep_last=1, is_driver=ctx.rank == 0)
        saved["moments"] = full_adam_moments(model, optimizer)
    return {
        **saved,
        "distributed": ddp.ddp_config.use_distributed_optimizer,
        "optimizer_types": {type(part).__name__ for part in parts},
        "inner_types": {type(part.optimizer).__name__ for part in parts},
        "state_bytes": adam_state_bytes(optimizer),
        "grad_norms": grad_norms,
        "weights": weights_after,
    }


@pytest.fixture(scope="module")
def plain_and_distributed():
    return {choice: run_distributed(train_steps_worker, 2, choice, timeout=600) for choice in ("false", "true")}


def test_distributed_optimizer_steps_equal_the_plain_optimizer(plain_and_distributed):
    plain, sharded = plain_and_distributed["false"], plain_and_distributed["true"]
    assert [r["distributed"] for r in plain] == [False, False]
    assert [r["distributed"] for r in sharded] == [True, True]
    assert all(r["optimizer_types"] == {"DistributedOptimizer"} for r in sharded)  # dense and expert parts
    initial = random_hf_state(tiny_test_config(), seed=3)
    for rank in range(2):
        for name, expected in plain[rank]["weights"].items():
            got = sharded[rank]["weights"][name]
            # within a thousandth of one step (lr 0.01): the sharded optimizer sums the data-parallel
            # gradients in another order (reduce-scatter), and Adam's normalised step m / (sqrt(v) + eps)
            # scales those last-bit differences up where a gradient is small (1.01e-6 seen on an AMD EPYC)
            assert (got - expected).abs().max().item() < 1e-5, f"rank {rank} {name}"
        assert sharded[rank]["grad_norms"] == pytest.approx(plain[rank]["grad_norms"], rel=1e-6)
    moved = max((plain[0]["weights"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 0.01  # three steps of lr 0.01 did move the weights


def test_distributed_optimizer_state_is_half_per_rank(plain_and_distributed):
    plain = [r["state_bytes"] for r in plain_and_distributed["false"]]
    sharded = [r["state_bytes"] for r in plain_and_distributed["true"]]
    assert plain[0] == plain[1] > 0  # replicated
    # the shards partition the parameters: together exactly the replicated state, each one half of it
    # up to megatron's split point (buffers are padded to a multiple of 128 * dp elements; a shard
    # boundary falls inside a parameter, so the halves differ by at most one padding unit of Adam state)
    assert sum(sharded) == plain[0]
    assert all(abs(b - plain[0] / 2) <= 2 * 4 * 128 * 2 for b in sharded), (sharded, plain)


def test_auto_shards_over_context_parallel_ranks():
    """cp=2, dp=1: the two ranks hold the same weights and megatron reduces their gradients over dp x cp,
    so ``auto`` shards the state over them and steps exactly as the plain optimizer does."""
    plain = run_distributed(train_steps_worker, 2, "false", cp=2, timeout=600)
    auto = run_distributed(train_steps_worker, 2, "auto", cp=2, timeout=600)
    assert [r["distributed"] for r in auto] == [True, True]
    for rank in range(2):
        for name, expected in plain[rank]["weights"].items():
            assert (auto[rank]["weights"][name] - expected).abs().max().item() < 1e-6, f"rank {rank} {name}"
    assert sum(r["state_bytes"] for r in auto) == plain[0]["state_bytes"] == plain[1]["state_bytes"]


def test_sharded_state_resumes_on_one_rank_exactly(tmp_path):
    """Saved by 2 data-parallel ranks (each holding half of every moment buffer), loaded by one:
    megatron reshards the 'dp_reshardable' checkpoint; every Adam moment arrives bit for bit."""
    two = run_distributed(train_steps_worker, 2, "true", checkpoint_dir=str(tmp_path), timeout=600)
    (one,) = run_distributed(train_steps_worker, 1, "true", checkpoint_dir=str(tmp_path), timeout=600)
    assert one["moments"].keys() == two[0]["moments"].keys()
    for name, loaded in one["moments"].items():
        for key, value in loaded.items():
            saved = two[0]["moments"][name][key] + two[1]["moments"][name][key]  # disjoint shards
            assert torch.equal(value, saved), f"{name} {key}"
            assert value.abs().sum() > 0 or "norm" in name, f"{name} {key}: no state was loaded"
    # megatron (no TE/Apex) loads every parameter's Adam step as one shared tensor holding 0 (torch's Adam
    # then counted every parameter: 0 -> 33 after one step): after one more step each count is 3 + 1
    assert one["adam_steps"] and set(one["adam_steps"]) == {STEPS + 1}, one["adam_steps"]


def test_optimizer_offload_steps_equal_the_device_optimizer():
    """optimizer.cpu_offload: megatron's HybridDeviceOptimizer inside its distributed optimizer (bf16 weights,
    fp32 main copies) on 2 gloo ranks, with all (fraction 1) or half (0.5) of each rank's Adam on host
    copies, steps 3 times exactly as the distributed optimizer without offload: the same grad norms and
    weights to 1e-6 (both step fp32 main weights with torch's AdamW). With ``optimizer.precision_aware``
    too (slime's 30B flags) the distributed optimizer keeps no fp32 main shards and the host optimizer's
    fp32 copies are the master weights: the same again (before ``policy/cpu_bridges.py`` kept the host
    mark on the fp32 copy of a host copy, the CPU build stepped none of them: the weights never moved)."""
    device = run_distributed(train_steps_worker, 2, "true", "bfloat16", timeout=600)
    for fraction, precision_aware in ((1.0, False), (0.5, False), (1.0, True), (0.5, True)):
        offloaded = run_distributed(
            train_steps_worker,
            2,
            "true",
            "bfloat16",
            cpu_offload=True,
            offload_fraction=fraction,
            precision_aware=precision_aware,
            timeout=600,
        )
        for rank in range(2):
            assert offloaded[rank]["inner_types"] == {"HybridDeviceOptimizer"}
            assert device[rank]["inner_types"] != {"HybridDeviceOptimizer"}
            assert offloaded[rank]["grad_norms"] == pytest.approx(device[rank]["grad_norms"], rel=1e-6)
            for name, expected in device[rank]["weights"].items():
                got = offloaded[rank]["weights"][name]
                where = f"fraction {fraction} precision_aware {precision_aware} rank {rank} {name}"
                assert (got - expected).abs().max().item() < 1e-6, where
    initial = random_hf_state(tiny_test_config(), seed=3)
    assert max((device[0]["weights"][k] - initial[k].float()).abs().max().item() for k in initial) > 0.01
