"""trainer.shared_prefix on one gloo rank: the packed forward gives the row layout's log-probs, parameter
gradients and routing recordings (contracts/shared_prefix.py, policy/models/shared_prefix_forward.py).

Two micro-batches, each with two groups of different prompt lengths and responses of different lengths (one
row's response is a single token, scored at the prompt's last input), a row-level policy-gradient loss with
random advantages. Float32 throughout: log-probs and gradients agree to rtol/atol 1e-5 (the packed forward
sums the same terms in another order: SDPA over other key sets, the gather's summed gradient); the recorded
experts are identical at every real token.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.contracts.shared_prefix import build_shared_prefix_layout
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import random_hf_state, tiny_family_config

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5


def _micro_batch(groups: list[tuple[int, list[int]]], vocab: int, generator: torch.Generator) -> MicroBatch:
    """Rows of ``groups`` (prompt length, response lengths), random tokens, right-padded to the longest row."""
    rows = []
    for prompt_len, response_lens in groups:
        prompt = torch.randint(1, vocab, (prompt_len,), generator=generator)
        rows += [(prompt, torch.randint(1, vocab, (n,), generator=generator)) for n in response_lens]
    width = max(len(p) + len(r) for p, r in rows) - 1
    b = len(rows)
    tokens, targets = torch.zeros(b, width, dtype=torch.long), torch.zeros(b, width, dtype=torch.long)
    response_mask, input_mask = torch.zeros(b, width), torch.zeros(b, width)
    for i, (prompt, response) in enumerate(rows):
        full = torch.cat([prompt, response])
        n = len(full) - 1
        tokens[i, :n], targets[i, :n] = full[:-1], full[1:]
        input_mask[i, :n] = 1
        response_mask[i, len(prompt) - 1 : n] = 1
    advantages = torch.randn(b, generator=generator)
    return MicroBatch(
        tokens=tokens, targets=targets, response_mask=response_mask, input_mask=input_mask, advantages=advantages
    )


def shared_prefix_worker(ctx, family: str) -> dict:
    from megatron.core import tensor_parallel

    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.conversion import load_hf_weights
    from gspo_megatron.policy.models.schedule import run_schedule, wrap_for_training
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel
    from gspo_megatron.policy.routing.replay import RoutingReplay

    cfg = tiny_family_config(family)
    layout = ParallelLayout(world_size=1).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=11)
    before = RoutingReplay.instance_count()
    model = build_model(cfg, layout)
    replay = RoutingReplay.capture_new_instances(before)
    load_hf_weights(model, cfg, random_hf_state(cfg, seed=3), mesh)
    ddp = wrap_for_training(model, model.config)

    generator = torch.Generator().manual_seed(5)
    plain = [
        _micro_batch([(7, [2, 4, 1]), (4, [3, 1, 5])], cfg.vocab_size, generator),
        _micro_batch([(3, [6, 2]), (5, [1, 3, 2])], cfg.vocab_size, generator),
    ]
    packed = []
    for mb in plain:
        mb_layout = build_shared_prefix_layout(mb.tokens, mb.response_mask, mb.input_mask)
        assert mb_layout is not None and mb_layout.num_groups == 2
        packed.append(MicroBatch(**{**mb.tensors(), "shared_prefix": mb_layout}))
    responses = sum(float(mb.response_mask.sum()) for mb in plain)

    def loss(logits, batch):
        logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch.targets)
        weighted = batch.advantages.unsqueeze(1) * logp * batch.response_mask
        return -weighted.sum() / responses, {"log_probs": logp.detach() * batch.input_mask}

    def run(micro_batches):
        replay.start_recording()
        outputs = run_schedule([ddp], micro_batches, loss, forward_only=True)
        routing, margins = replay.recorded(), replay.recorded_margins()
        replay.stop()
        ddp.zero_grad_buffer()
        run_schedule([ddp], micro_batches, loss, forward_only=False)
        grads = {name: p.main_grad.detach().clone() for name, p in model.named_parameters()}
        return {"log_probs": [o["log_probs"] for o in outputs], "grads": grads, "routing": routing, "margins": margins}

    result = {"plain": run(plain), "packed": run(packed)}
    # control: the same packed layout at megatron's own positions 0..S'-1 (no RoPE hook's effect) differs
    import dataclasses

    unhooked = [
        dataclasses.replace(
            mb,
            shared_prefix=dataclasses.replace(
                mb.shared_prefix,
                position_ids=torch.arange(mb.shared_prefix.packed_len).expand_as(mb.shared_prefix.tokens),
            ),
        )
        for mb in packed
    ]
    result["unhooked"] = [o["log_probs"] for o in run_schedule([ddp], unhooked, loss, forward_only=True)]
    result["real"] = [mb.input_mask.bool() for mb in plain]
    mesh.destroy()
    return result


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])  # glm4_moe: partial RoPE, sigmoid router
def test_shared_prefix_matches_row_layout(family):
    (result,) = run_distributed(shared_prefix_worker, 1, family)
    plain, packed = result["plain"], result["packed"]
    max_logp = max(float((a - b).abs().max()) for a, b in zip(plain["log_probs"], packed["log_probs"], strict=True))
    for a, b in zip(plain["log_probs"], packed["log_probs"], strict=True):
        torch.testing.assert_close(b, a, rtol=TOLERANCE, atol=TOLERANCE)
    max_grad = 0.0
    assert plain["grads"].keys() == packed["grads"].keys()
    taking_part = sum(bool(grad.abs().max() > 0) for grad in plain["grads"].values())
    assert taking_part > 0.8 * len(plain["grads"])  # most weights get a gradient (an expert may get no token)
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(packed["grads"][name], grad, rtol=TOLERANCE, atol=TOLERANCE, msg=name)
        max_grad = max(max_grad, float((packed["grads"][name] - grad).abs().max()))
    # routing recordings: [micro_batch][layer] -> [s * b, k] in the row layout's order, the same experts at
    # every real token (padding tokens are routed as the group's first prompt token under packing)
    assert len(plain["routing"]) == len(packed["routing"]) == 2
    for mb, real in enumerate(result["real"]):
        keep = real.t().reshape(-1)  # router order: sequence-major
        for a, b in zip(plain["routing"][mb], packed["routing"][mb], strict=True):
            assert a.shape == b.shape
            assert torch.equal(a[keep].sort(-1).values, b[keep].sort(-1).values)
        for a, b in zip(plain["margins"][mb], packed["margins"][mb], strict=True):
            torch.testing.assert_close(b[keep], a[keep], rtol=TOLERANCE, atol=TOLERANCE)
    shifted = max(float((a - b).abs().max()) for a, b in zip(plain["log_probs"], result["unhooked"], strict=True))
    assert shifted > 1e-3  # the positions matter: the RoPE hook is what makes the two agree
    print(f"max |d log p| = {max_logp:.3g}, max |d grad| = {max_grad:.3g}, without positions {shifted:.3g}")


def refusal_worker(ctx, kind: str) -> str:
    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.shared_prefix_forward import SharedPrefixError, forward_packed
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel
    from gspo_megatron.policy.routing.replay import RoutingReplay
    from gspo_megatron.testing.model_fixtures import tiny_yarn_config

    configs = {
        "linear_attention": lambda: tiny_family_config("qwen3_next"),
        "yarn": lambda: tiny_yarn_config("qwen3_moe"),
    }
    cfg = configs.get(kind, lambda: tiny_family_config("qwen3_moe"))()
    layout = ParallelLayout(world_size=1).validate(cfg)
    apply_cpu_bridges()
    mesh = initialize_parallel(layout, seed=11)
    before = RoutingReplay.instance_count()
    model = build_model(cfg, layout, layer_spec="portable")
    if kind == "replay":  # routers armed with (row-layout) targets
        replay = RoutingReplay.capture_new_instances(before)
        replay.load_targets([[torch.zeros(1, cfg.top_k, dtype=torch.long) for _ in replay.instances]])
    mb = _micro_batch([(4, [2, 3])], cfg.vocab_size, torch.Generator().manual_seed(1))
    mb_layout = build_shared_prefix_layout(mb.tokens, mb.response_mask, mb.input_mask)
    assert mb_layout is not None
    try:
        forward_packed(model, mb_layout)
    except SharedPrefixError as error:
        return str(error)
    finally:
        mesh.destroy()
    return "not refused"


@pytest.mark.parametrize(
    "kind, fragment",
    [
        ("linear_attention", "softmax attention in every layer"),
        ("yarn", "YarnRotaryEmbedding"),
        ("replay", "routing replay targets are in the row layout"),
    ],
)
def test_the_packed_forward_refuses_models_it_cannot_serve(kind, fragment):
    (message,) = run_distributed(refusal_worker, 1, kind)
    assert fragment in message and "trainer.shared_prefix=false" in message, message
