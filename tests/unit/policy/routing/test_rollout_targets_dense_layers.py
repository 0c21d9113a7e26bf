"""R3 targets of a model with a dense layer (GLM-4.5's first k, Qwen's mlp_only_layers) come from its
MoE layers only, whatever an engine writes for the dense one. The embedded engine writes -1 there;
SGLang writes nothing, so its row keeps the capture buffer's initial zeros (read in SGLang 0.5's
``state_capturer/base.py``: the device buffer is ``torch.zeros((batch, num_hidden_layers, top_k))`` and
only MoE layers call ``capture``) -- zeros that look like expert 0 and must never be replayed."""

from __future__ import annotations

import torch

from gspo_megatron.policy.routing.replay import moe_layer_indices, rollout_targets
from gspo_megatron.testing.model_fixtures import tiny_family_config


def test_a_dense_layers_entries_are_never_targets():
    cfg = tiny_family_config("glm4_moe")  # layer 0 dense, layers 1..3 MoE
    generator = torch.Generator().manual_seed(0)
    routed = torch.randint(0, cfg.num_experts, (2, 5, cfg.num_layers, cfg.top_k), generator=generator)
    embedded, sglang = routed.clone(), routed.clone()
    embedded[:, :, 0] = -1  # the embedded engine's "no expert"
    sglang[:, :, 0] = 0  # SGLang's untouched capture buffer
    layers = moe_layer_indices(cfg)
    assert layers == [1, 2, 3]
    from_embedded = rollout_targets(embedded, layers, tp_rank=0, tp_size=1, sequence_parallel=False)
    from_sglang = rollout_targets(sglang, layers, tp_rank=0, tp_size=1, sequence_parallel=False)
    assert len(from_embedded) == 3
    for a, b, layer in zip(from_embedded, from_sglang, layers, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a, routed[:, :, layer].transpose(0, 1).reshape(-1, cfg.top_k))
