"""Issue 4 done-when: the EmbeddedEngine and the Megatron model agree when they hold the same weights.

The path is the trainer's: random HF-named weights -> ``load_hf_weights`` into the Megatron model
(one rank, TP=2 with sequence parallelism, EP=2) -> streamed ``export_hf_weights`` buckets ->
``EmbeddedEngine.update_weights`` on the driver rank. The engine samples responses (KV-cache
decode, left-padded prompts of different lengths, temperature 0.8) and reports the log-prob of each
sampled token and the experts every MoE layer routed each token to. Megatron then scores the same
sequences (right-padded, two micro-batches, ``LogProbHead`` = the trainer's old-log-prob head) with
``RoutingReplay`` recording, and:
- its per-token log-probs equal the engine's within fp32 tolerance;
- its recorded top-k expert sets equal the engine's routed experts at every real token of every
  MoE layer (the layout R3 replays; ``rollout_targets`` puts them back into megatron's order).
For every model family (``core/model_families.py``): the engine is transformers' own class of
the family, so this is also megatron's forward against transformers' on the same weights.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import (
    FAMILY_TEST_OVERRIDES,
    random_hf_state,
    tiny_family_config,
    tiny_yarn_config,
)

pytestmark = pytest.mark.distributed

TEMPERATURE = 0.8
PROMPTS = [[3, 17, 5, 9, 30], [1, 2], [8, 8, 8, 21, 4, 11, 6, 19, 2], [25, 14, 7]]
SAMPLES_PER_PROMPT = 2
MAX_NEW_TOKENS = 5


def engine_vs_megatron_worker(ctx, cfg, state: dict, layout_kwargs: dict) -> dict:
    import torch.distributed as dist

    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.loss_heads import LogProbHead
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.conversion import export_hf_weights, load_hf_weights
    from gspo_megatron.policy.models.schedule import run_schedule
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel
    from gspo_megatron.policy.routing.replay import (
        RoutingReplay,
        layer_topk_to_tensor,
        moe_layer_indices,
        rollout_targets,
    )

    layout = ParallelLayout(**layout_kwargs).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=5)
    before = RoutingReplay.instance_count()
    model = build_model(cfg, layout, layer_spec="portable")
    replay = RoutingReplay.capture_new_instances(before)
    load_hf_weights(model, cfg, state, mesh)
    model.eval()

    # Weight sync exactly as the trainer does it: every rank iterates the collective export, the
    # driver streams the buckets into its engine.
    engine = _driver_engine(cfg) if mesh.is_driver else None
    buckets = export_hf_weights(model, cfg, mesh, bucket_bytes=16 << 10)
    streamed = (pair for bucket in buckets for pair in bucket)
    if engine is not None:
        engine.update_weights(streamed, version=1)
    else:
        for _ in streamed:
            pass

    payload = [_generate(engine) if engine is not None else None]
    dist.broadcast_object_list(payload, src=0)
    samples = payload[0]

    micro_batches, valid = _right_padded_micro_batches(samples, multiple=2 * layout.tp)
    replay.start_recording()
    head = LogProbHead(mesh.tp_group, TEMPERATURE)
    outputs = run_schedule([model], micro_batches, head, forward_only=True)
    recorded = replay.recorded()
    replay.stop()

    # Megatron order per micro-batch: [s_local * b, k] per layer -> [b, s, layers, k] on every rank.
    routing = []
    for mb, per_layer in zip(micro_batches, recorded, strict=True):
        local = layer_topk_to_tensor(per_layer, mb.tokens.shape[0])
        if layout.use_sequence_parallel:
            parts = [torch.empty_like(local) for _ in range(layout.tp)]
            dist.all_gather(parts, local.contiguous(), group=mesh.tp_group)
            local = torch.cat(parts, dim=1)
        routing.append(local)
    megatron_routing = torch.cat(routing, dim=0)

    # The engine's routed experts, put into megatron's per-rank order by the R3 helper.
    engine_routing = torch.zeros_like(megatron_routing)
    for row, sample in enumerate(samples):
        engine_routing[row, : sample["routed"].shape[0]] = sample["routed"][:, moe_layer_indices(cfg)].long()
    r3_targets_match = True
    for index, mb in enumerate(micro_batches):
        b = mb.tokens.shape[0]
        rows = slice(index * b, (index + 1) * b)
        targets = rollout_targets(
            engine_routing[rows].clamp_min(0),
            list(range(len(moe_layer_indices(cfg)))),
            mesh.tp_rank,
            layout.tp,
            layout.use_sequence_parallel,
        )
        mask = _megatron_order(valid[rows], mesh.tp_rank, layout.tp, layout.use_sequence_parallel)
        for target, rec in zip(targets, recorded[index], strict=True):
            same = (target.sort(-1).values == rec.sort(-1).values).all(-1)
            r3_targets_match &= bool(same[mask].all())

    log_probs = torch.cat([out.log_probs for out in outputs], dim=0) if outputs else None
    mesh.destroy()
    return {
        "samples": samples,
        "valid": valid,
        "megatron_log_probs": log_probs,
        "megatron_routing": megatron_routing,
        "r3_targets_match": r3_targets_match,
        "engine_version": None if engine is None else engine.weight_version,
    }


def _driver_engine(cfg):
    from gspo_megatron.rollout.config import EmbeddedConfig
    from gspo_megatron.rollout.embedded.engine import EmbeddedEngine

    return EmbeddedEngine(cfg.to_hf_config(), EmbeddedConfig(max_batch_size=16, seed=0))


def _generate(engine) -> list[dict]:
    from gspo_megatron.contracts.samples import SamplingParams

    params = SamplingParams(
        temperature=TEMPERATURE,
        max_new_tokens=MAX_NEW_TOKENS,
        n=SAMPLES_PER_PROMPT,
        seed=42,
        return_routed_experts=True,
    )
    groups = engine.generate(PROMPTS, params)
    return [
        {"prompt": s.prompt_ids, "output": s.output_ids, "log_probs": s.output_log_probs, "routed": s.routed_experts}
        for group in groups
        for s in group
    ]


def _right_padded_micro_batches(samples: list[dict], multiple: int):
    """Two micro-batches of [b, L]: inputs = sequence[:-1], targets = sequence[1:], right padding."""
    lengths = [len(s["prompt"]) + len(s["output"]) - 1 for s in samples]
    width = -(-max(lengths) // multiple) * multiple
    tokens = torch.zeros(len(samples), width, dtype=torch.long)
    targets = torch.zeros(len(samples), width, dtype=torch.long)
    valid = torch.zeros(len(samples), width, dtype=torch.bool)
    for row, sample in enumerate(samples):
        sequence = torch.tensor(sample["prompt"] + sample["output"])
        tokens[row, : len(sequence) - 1] = sequence[:-1]
        targets[row, : len(sequence) - 1] = sequence[1:]
        valid[row, : len(sequence) - 1] = True
    half = len(samples) // 2
    micro_batches = [
        MicroBatch(tokens=tokens[i : i + half], targets=targets[i : i + half], rows=torch.arange(i, i + half))
        for i in range(0, len(samples), half)
    ]
    return micro_batches, valid


def _megatron_order(mask_bs: torch.Tensor, tp_rank: int, tp: int, sequence_parallel: bool) -> torch.Tensor:
    per_token = mask_bs.transpose(0, 1)  # [s, b]
    if sequence_parallel and tp > 1:
        per_token = per_token.chunk(tp, dim=0)[tp_rank]
    return per_token.reshape(-1)


LAYOUTS = {
    "single": dict(world_size=1),
    "tp2": dict(tp=2, world_size=2),
    "ep2": dict(ep=2, world_size=2),
}


# every family, and YaRN RoPE scaling under both attentions (transformers' YaRN against megatron's)
MODELS = sorted(FAMILY_TEST_OVERRIDES) + ["qwen3_moe+yarn", "deepseek_v3+yarn"]


@pytest.fixture(scope="module", params=MODELS)
def setup(request):
    family, _, scaling = request.param.partition("+")
    cfg = tiny_yarn_config(family) if scaling else tiny_family_config(family)
    return cfg, random_hf_state(cfg, seed=11, scale=0.3)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_engine_matches_megatron(setup, name):
    cfg, state = setup
    layout = LAYOUTS[name]
    results = run_distributed(engine_vs_megatron_worker, layout["world_size"], cfg, state, layout, timeout=600)
    driver = results[0]
    assert driver["engine_version"] == 1
    samples, valid = driver["samples"], driver["valid"]
    assert len(samples) == len(PROMPTS) * SAMPLES_PER_PROMPT
    assert all(len(s["output"]) == MAX_NEW_TOKENS for s in samples)  # no stop tokens: full length

    for result in results:
        if result["megatron_log_probs"] is None:
            continue
        megatron = result["megatron_log_probs"]
        for row, sample in enumerate(samples):
            start = len(sample["prompt"]) - 1  # the target of input position p-1 is output token 0
            scored = megatron[row, start : start + len(sample["output"])]
            torch.testing.assert_close(
                scored, sample["log_probs"], rtol=1e-4, atol=1e-5, msg=lambda m, row=row: f"{name} row {row}: {m}"
            )
        # Prompt tokens are scored too, and they are real log-probs (< 0, finite).
        assert torch.isfinite(megatron[valid]).all() and (megatron[valid] < 0).all()

    moe_layers = [i for i in range(cfg.num_layers) if i not in cfg.dense_layers]
    for result in results:
        megatron_routing = result["megatron_routing"]  # [rows, L, moe layers, k]
        for row, sample in enumerate(samples):
            engine = sample["routed"][:, moe_layers].long()  # [prompt + output - 1, moe layers, k]
            assert engine.min() >= 0
            mine = megatron_routing[row, : engine.shape[0]]
            assert torch.equal(mine.sort(-1).values, engine.sort(-1).values), f"{name} row {row}: routing differs"
        assert result["r3_targets_match"]
    # Not a vacuous match: tokens spread over several expert sets in every MoE layer.
    routing = results[0]["megatron_routing"][valid]  # [tokens, moe layers, k]
    for layer in range(routing.shape[1]):
        assert len({tuple(row) for row in routing[:, layer].sort(-1).values.tolist()}) > 1
