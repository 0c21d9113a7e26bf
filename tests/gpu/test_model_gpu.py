"""The kernel choices that only run on a GPU, on the tiny Qwen3-MoE: NCCL collectives and CUDA tensors,
bf16 forward+backward, the TransformerEngine spec, TEGroupedMLP, ``torch._grouped_mm``'s CUDA kernel,
the alltoall dispatcher's CUDA streams (on CPU bridged, ``policy/cpu_bridges.py``), TP=2 over NCCL.

Skipped without CUDA (and the TE / Hopper / two-GPU cases without TransformerEngine / compute
capability 9.0 / a second GPU). Every case
runs in spawned ranks through ``run_distributed``, which on a CUDA machine initialise NCCL through
``initialize_parallel``. References are fp32 runs of the same weights and batch, so the checks are
equivalences, not fixed numbers:
- bf16 log-probs stay within bf16 noise of fp32, gradients point the same way (cosine > 0.99);
- the TE spec (fused layer-norm linears, TE attention) equals the portable spec in fp32;
- TP=2 (sequence parallel) equals one rank in fp32, as on CPU;
- the grouped experts (``_grouped_mm`` in bf16 on Hopper; TEGroupedMLP with TE) equal SequentialMLP,
  and the alltoall dispatcher equals allgather on EP=2, as the CPU suite checks for the CPU kernels.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import model_variants_worker, random_hf_state, tiny_test_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HAS_TE = importlib.util.find_spec("transformer_engine") is not None
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
HOPPER = GPUS > 0 and torch.cuda.get_device_capability(0) >= (9, 0)  # torch._grouped_mm's CUDA kernel


def gpu_model_worker(ctx, cfg, state: dict, layout_kwargs: dict, dtype_name: str, layer_spec: str) -> dict:
    """Forward+backward of a weighted log-likelihood on this rank's device; results moved to CPU fp32."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.builder import build_model
    from gspo_megatron.policy.models.conversion import export_hf_state_dict, gradient_of, load_hf_weights
    from gspo_megatron.policy.models.schedule import run_schedule, wrap_for_training
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel
    from gspo_megatron.testing.model_fixtures import fixed_batch

    layout = ParallelLayout(**layout_kwargs).validate(cfg)
    apply_cpu_bridges()
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


def _to_cpu(value):
    """Tensors of a rank's results moved to the CPU (CUDA tensors cannot outlive their process)."""
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def variants_gpu_worker(ctx, cfg, state: dict, layout_kwargs: dict, variants: list[dict]) -> dict:
    """``model_variants_worker`` on this rank's GPU (one result per ``build_model`` variant), with the
    module classes each variant built and the number of ``torch._grouped_mm`` calls of the whole run."""
    from unittest import mock

    import gspo_megatron.policy.models.builder as builder

    built: list[set[str]] = []
    real_build, real_grouped_mm = builder.build_model, torch._grouped_mm
    grouped_mm_calls = []

    def recording_build(*args, **kwargs):
        model = real_build(*args, **kwargs)
        built.append({type(module).__name__ for module in model.modules()})
        return model

    def counting_grouped_mm(*args, **kwargs):
        grouped_mm_calls.append(args[0].device.type)
        return real_grouped_mm(*args, **kwargs)

    with (
        mock.patch.object(builder, "build_model", recording_build),
        mock.patch.object(torch, "_grouped_mm", counting_grouped_mm),
    ):
        results = model_variants_worker(ctx, cfg, state, layout_kwargs, variants)
    return {"results": _to_cpu(results), "modules": built, "grouped_mm_devices": grouped_mm_calls}


def _assert_close_results(reference: dict, candidate: dict, log_prob_atol: float, grad_cosine: float) -> None:
    assert candidate["log_probs"].keys() == reference["log_probs"].keys()
    for dp_rank, logp in reference["log_probs"].items():
        assert torch.isfinite(candidate["log_probs"][dp_rank]).all()
        torch.testing.assert_close(candidate["log_probs"][dp_rank], logp, rtol=0.0, atol=log_prob_atol)
    for key, grad in reference["grads"].items():
        assert torch.isfinite(candidate["grads"][key]).all(), key
        if grad.norm() > 1e-6:
            assert _cosine(candidate["grads"][key].float(), grad.float()) > grad_cosine, key


@pytest.mark.skipif(not HOPPER, reason="torch._grouped_mm on CUDA needs compute capability >= 9.0")
def test_grouped_mm_cuda_kernel_equals_sequential_mlp(weights):
    """bf16 on Hopper: ``policy/models/grouped_experts.py`` takes ``torch._grouped_mm``'s CUDA kernel (on CPU
    its C++ loop is what the unit and distributed suites check) and equals SequentialMLP's loop."""
    cfg, state = weights
    variants = [
        {"params_dtype": torch.bfloat16, "layer_spec": "portable", "expert_mlp": "sequential"},
        {"params_dtype": torch.bfloat16, "layer_spec": "portable", "expert_mlp": "grouped"},
    ]
    (run,) = run_distributed(variants_gpu_worker, 1, cfg, state, dict(world_size=1), variants, timeout=600)
    assert "GroupedExperts" not in run["modules"][0] and "GroupedExperts" in run["modules"][1]
    # forward fc1 + fc2 and backward (rows and weights of each) per layer, every call on the GPU
    assert run["grouped_mm_devices"] and set(run["grouped_mm_devices"]) == {"cuda"}
    sequential, grouped = run["results"]
    # the same bf16 weights, GEMMs accumulated in fp32 in another order: bf16 rounding apart
    _assert_close_results(sequential, grouped, log_prob_atol=5e-2, grad_cosine=0.99)


@pytest.mark.skipif(not HAS_TE, reason="transformer_engine is not installed")
def test_te_grouped_mlp_equals_sequential_mlp(weights):
    """With TE, ``model.expert_mlp=grouped`` is megatron's TEGroupedMLP (``moe_grouped_gemm``); it
    equals the TE spec's SequentialMLP on the same HF weights (fp32; TF32 tolerances)."""
    cfg, state = weights
    variants = [
        {"layer_spec": "te", "expert_mlp": "sequential"},
        {"layer_spec": "te", "expert_mlp": "grouped"},
    ]
    (run,) = run_distributed(variants_gpu_worker, 1, cfg, state, dict(world_size=1), variants, timeout=600)
    assert "TEGroupedMLP" not in run["modules"][0] and "TEGroupedMLP" in run["modules"][1]
    sequential, grouped = run["results"]
    _assert_close_results(sequential, grouped, log_prob_atol=2e-3, grad_cosine=0.999)


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_alltoall_equals_allgather_on_two_gpus(weights):
    """EP=2 over NCCL: megatron's alltoall dispatcher with its real CUDA side stream (bridged on CPU)
    gives allgather's forward and backward."""
    cfg, state = weights
    variants = [{"token_dispatcher": "allgather"}, {"token_dispatcher": "alltoall"}]
    runs = run_distributed(variants_gpu_worker, 2, cfg, state, dict(ep=2, world_size=2), variants, timeout=600)
    assert any(run["results"][1]["log_probs"] for run in runs)
    for run in runs:
        allgather, alltoall = run["results"]
        for dp_rank, logp in allgather["log_probs"].items():
            torch.testing.assert_close(alltoall["log_probs"][dp_rank], logp, rtol=1e-5, atol=1e-5)
        for key, grad in allgather["grads"].items():
            torch.testing.assert_close(
                alltoall["grads"][key], grad, rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}"
            )
