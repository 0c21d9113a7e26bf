"""The tiny Qwen3-MoE on CUDA: NCCL init, bf16 forward+backward, TE spec, single rank vs TP=2.

Skipped without CUDA (and the TE / TP=2 cases without TransformerEngine / a second GPU). Every case
runs in spawned ranks through ``run_distributed``, which on a CUDA machine initialise NCCL through
``initialize_parallel``. References are fp32 runs of the same weights and batch, so the checks are
equivalences, not fixed numbers:
- bf16 log-probs stay within bf16 noise of fp32, gradients point the same way (cosine > 0.99);
- the TE spec (fused layer-norm linears, TE attention) equals the portable spec in fp32;
- TP=2 (sequence parallel) equals one rank in fp32, as on CPU.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gspo_megatron.models.micro_batch import MicroBatch
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import random_hf_state, tiny_test_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HAS_TE = importlib.util.find_spec("transformer_engine") is not None
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_model_worker(ctx, cfg, state: dict, layout_kwargs: dict, dtype_name: str, layer_spec: str) -> dict:
    """Forward+backward of a weighted log-likelihood on this rank's device; results moved to CPU fp32."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from gspo_megatron.models.builder import build_model
    from gspo_megatron.models.conversion import export_hf_state_dict, gradient_of, load_hf_weights
    from gspo_megatron.models.schedule import run_schedule, wrap_for_training
    from gspo_megatron.parallel.layout import ParallelLayout
    from gspo_megatron.parallel.mesh import initialize_parallel
    from gspo_megatron.testing.model_fixtures import fixed_batch

    layout = ParallelLayout(**layout_kwargs).validate(cfg)
    mesh = initialize_parallel(layout, seed=11)
    dtype = getattr(torch, dtype_name)
    model = build_model(cfg, layout, params_dtype=dtype, layer_spec=layer_spec)
    load_hf_weights(model, cfg, state, mesh)
    ddp = wrap_for_training(model, model.config)
    ddp.zero_grad_buffer()

    device = mesh.device
    inputs, targets, weights = (t.to(device) for t in fixed_batch(cfg, batch=4, seq=16))
    total_tokens = weights.numel()
    rows = inputs.shape[0] // layout.dp
    sl = slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows)
    micro_batches = [
        MicroBatch(tokens=inputs[sl][i : i + 1], targets=targets[sl][i : i + 1], weights=weights[sl][i : i + 1])
        for i in range(rows)
    ]

    def loss_callback(logits, batch):
        logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch.targets)
        loss = -(batch.weights * logp).sum() / total_tokens
        return loss, {"log_probs": logp.detach(), "loss": loss.detach()}

    metrics = run_schedule([ddp], micro_batches, loss_callback, forward_only=False)
    if torch.cuda.is_available():  # (the worker also runs on CPU when checking the test itself)
        torch.cuda.synchronize()
    grads = {k: v.float().cpu() for k, v in export_hf_state_dict(model, cfg, mesh, tensor_of=gradient_of).items()}
    params = list(model.parameters())
    out = {
        "backend": dist.get_backend(),
        "param_devices": sorted({p.device.type for p in params}),
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "log_probs": {mesh.dp_rank: torch.cat([m["log_probs"] for m in metrics]).float().cpu()} if metrics else {},
        "grads": grads,
        "parameter_names": [name for name, _ in model.named_parameters()],
    }
    mesh.destroy()
    return out


@pytest.fixture(scope="module")
def weights():
    cfg = tiny_test_config()
    return cfg, random_hf_state(cfg, seed=3)


@pytest.fixture(scope="module")
def fp32_portable(weights):
    cfg, state = weights
    (result,) = run_distributed(gpu_model_worker, 1, cfg, state, dict(world_size=1), "float32", "portable", timeout=600)
    return result


def _log_probs(results) -> torch.Tensor:
    pieces = {}
    for result in results:
        pieces.update(result["log_probs"])
    return torch.cat([pieces[r] for r in sorted(pieces)])


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def test_nccl_and_cuda_placement(fp32_portable):
    assert fp32_portable["backend"] == "nccl"
    assert fp32_portable["param_devices"] == ["cuda"]
    assert fp32_portable["param_dtypes"] == ["torch.float32"]
    assert max(g.abs().max().item() for g in fp32_portable["grads"].values()) > 0


def test_bf16_forward_backward_tracks_fp32(weights, fp32_portable):
    cfg, state = weights
    (bf16,) = run_distributed(gpu_model_worker, 1, cfg, state, dict(world_size=1), "bfloat16", "portable", timeout=600)
    assert bf16["param_dtypes"] == ["torch.bfloat16"]
    reference = _log_probs([fp32_portable])
    log_probs = _log_probs([bf16])
    assert torch.isfinite(log_probs).all()
    # bf16 has an 8-bit mantissa: per-token log-probs of a 32-token vocab move by a few 1e-2 at most
    torch.testing.assert_close(log_probs, reference, rtol=0.0, atol=0.1)
    for key, grad in fp32_portable["grads"].items():
        assert torch.isfinite(bf16["grads"][key]).all(), key
        if grad.norm() > 1e-6:
            assert _cosine(bf16["grads"][key], grad) > 0.99, key


@pytest.mark.skipif(not HAS_TE, reason="transformer_engine is not installed")
def test_te_spec_equals_portable_spec(weights, fp32_portable):
    cfg, state = weights
    (te,) = run_distributed(gpu_model_worker, 1, cfg, state, dict(world_size=1), "float32", "te", timeout=600)
    # the TE spec really is in use: the pre-attention norm is fused into the QKV linear
    assert any(name.endswith("linear_qkv.layer_norm_weight") for name in te["parameter_names"])
    # TF32 may be on for TE GEMMs: allow its ~1e-3 relative error
    torch.testing.assert_close(_log_probs([te]), _log_probs([fp32_portable]), rtol=2e-3, atol=2e-3)
    for key, grad in fp32_portable["grads"].items():
        torch.testing.assert_close(te["grads"][key], grad, rtol=2e-2, atol=1e-4, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_tp2_equals_single_rank(weights, fp32_portable):
    cfg, state = weights
    results = run_distributed(
        gpu_model_worker, 2, cfg, state, dict(tp=2, world_size=2), "float32", "portable", timeout=600
    )
    torch.testing.assert_close(_log_probs(results), _log_probs([fp32_portable]), rtol=1e-4, atol=1e-4)
    for result in results:
        assert result["backend"] == "nccl"
        for key, grad in fp32_portable["grads"].items():
            torch.testing.assert_close(
                result["grads"][key], grad, rtol=1e-3, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
            )
