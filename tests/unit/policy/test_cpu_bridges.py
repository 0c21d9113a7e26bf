"""Each bridge of policy/cpu_bridges.py: what megatron-core does on this CUDA-less machine without it
(the failure it bridges), and what it does with it. ``disable_cpu_megatron`` must give every
patched attribute back, so the "without" half runs megatron's own code."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.policy import cpu_bridges as cpu_compat
from gspo_megatron.policy.parallel.context_parallel import split_sequence

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the bridges only exist without CUDA")


@pytest.fixture
def bridges():
    """Start with megatron's own code; leave the process as it was found."""
    was_enabled = cpu_compat.cpu_megatron_enabled()
    cpu_compat.disable_cpu_megatron()
    yield
    cpu_compat.disable_cpu_megatron()
    if was_enabled:
        cpu_compat.enable_cpu_megatron()


def test_enable_is_idempotent_and_disable_restores_every_attribute(bridges):
    from megatron.core.optimizer import optimizer
    from megatron.core.pipeline_parallel import schedules

    before = (torch.cuda.current_device, optimizer.clip_grad_by_total_norm_fp32, schedules.torch)
    cpu_compat.enable_cpu_megatron()
    patched = len(cpu_compat._applied)
    cpu_compat.enable_cpu_megatron()
    assert len(cpu_compat._applied) == patched  # applied once per process
    assert schedules.torch is not torch
    cpu_compat.disable_cpu_megatron()
    assert (torch.cuda.current_device, optimizer.clip_grad_by_total_norm_fp32, schedules.torch) == before
    assert "record_stream" not in vars(torch.Tensor)  # inherited from the C base class again


def test_forming_process_groups_patches_nothing_and_names_the_start_up_call(bridges):
    # the bridges are applied by one start-up call, never as a side effect of initialize_parallel
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    with pytest.raises(RuntimeError, match=r"call gspo_megatron\.policy\.cpu_bridges\.apply_cpu_bridges\(\)"):
        initialize_parallel(ParallelLayout(world_size=1).validate())
    assert not cpu_compat.cpu_megatron_enabled() and cpu_compat._applied == []


def test_the_start_up_call_says_which_bridges_applied(bridges):
    from importlib.metadata import version

    line = cpu_compat.apply_cpu_bridges()
    names = [bridge.__name__.lstrip("_") for bridge in cpu_compat.BRIDGES]
    applied = [name for name in names if name in line]
    assert line.startswith(f"[gspo] megatron-core {version('megatron-core')} without CUDA: {len(applied)} CPU bridges")
    # 0.16 lacks te_general_gemm (bridge 3 defines it); 0.17+ defines it, and that bridge patches nothing;
    # bridge 12 patches nothing where FLA is installed or megatron keeps gated DeltaNet's imports elsewhere
    assert set(names) - set(applied) <= {"define_missing_te_general_gemm", "gated_delta_net_without_fla"}
    assert cpu_compat.apply_cpu_bridges() == line  # once per process: a second call applies nothing more


def test_1_current_device(bridges):
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()
    cpu_compat.enable_cpu_megatron()
    assert torch.cuda.current_device() == torch.device("cpu")


def test_2_rng_tracker_forks_reproducible_cpu_streams(bridges):
    from megatron.core.tensor_parallel import random as mrandom

    cpu_compat.enable_cpu_megatron()
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    outer = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        first = torch.rand(3)
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(3)  # the forked stream continues, it does not restart
    assert torch.equal(torch.get_rng_state(), outer)  # the outer stream is untouched
    g = torch.Generator().manual_seed(123)
    assert torch.equal(first, torch.rand(3, generator=g)) and torch.equal(second, torch.rand(3, generator=g))


def test_2_without_the_bridge_megatron_keeps_cuda_generator_states(bridges):
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker()
    with pytest.raises((RuntimeError, AssertionError, AttributeError)):
        tracker.add("model-parallel-rng", 123)  # torch.cuda.get_rng_state / manual_seed need CUDA


def test_3_router_gemm_runs_without_transformer_engine(bridges):
    """megatron-core 0.16 defines ``te_general_gemm`` only when TransformerEngine imports, then reads it
    in the router GEMM (NameError); 0.17+ defines it as None. The bridge is applied exactly where the
    name is missing, and either way the router's logits are x @ w^T."""
    from megatron.core.transformer.moe import moe_utils

    x, w = torch.randn(5, 8), torch.randn(4, 8)
    name_missing = not hasattr(moe_utils, "te_general_gemm")
    if name_missing:
        with pytest.raises(NameError, match="te_general_gemm"):
            moe_utils.router_gating_linear(x, w, None, torch.float32)
    cpu_compat.enable_cpu_megatron()
    bridged = any(owner is moe_utils and name == "te_general_gemm" for owner, name, _ in cpu_compat._applied)
    assert bridged == name_missing  # keyed to the version's need: nothing patched where megatron has it
    assert moe_utils.te_general_gemm is None  # the intended "no TE" fallback, megatron's or ours
    torch.testing.assert_close(moe_utils.router_gating_linear(x, w, None, torch.float32), x @ w.T)


def test_4_cuda_literals_allocate_on_cpu(bridges):
    from megatron.core.pipeline_parallel import schedules

    with pytest.raises((RuntimeError, AssertionError)):
        schedules.torch.zeros(1, device="cuda")
    cpu_compat.enable_cpu_megatron()
    assert schedules.torch.zeros(2, device="cuda").device.type == "cpu"
    assert schedules.torch.tensor([1.0], device=torch.device("cuda")).device.type == "cpu"
    with schedules.torch.autocast("cuda"):  # a no-op instead of a CUDA autocast region
        assert torch.ones(1).dtype == torch.float32
    assert schedules.torch.float32 is torch.float32  # everything else is torch itself


def test_5_synchronize_streams_and_record_stream_are_noops(bridges):
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.synchronize()
    with pytest.raises((RuntimeError, AssertionError)):  # megatron 0.19's grad sync asks for it unconditionally
        torch.cuda.current_stream()
    cpu_compat.enable_cpu_megatron()
    assert torch.cuda.synchronize() is None
    assert torch.ones(1).record_stream(None) is None
    stream = torch.cuda.current_stream()  # what megatron's start_grad_sync calls wait_event / wait_stream on
    assert stream.wait_stream(stream) is None and stream.wait_event(torch.cpu.Event()) is None


def test_6_clip_grads_scales_cpu_fp32_grads(bridges):
    from megatron.core.optimizer import optimizer

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    for p, g in zip(params, (torch.tensor([3.0, 0.0, 4.0]), torch.tensor([1.0, 2.0])), strict=True):
        p.grad = g.clone()
    with pytest.raises(AssertionError):  # "param.grad.type() == 'torch.cuda.FloatTensor'"
        optimizer.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=10.0)
    cpu_compat.enable_cpu_megatron()
    optimizer.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=10.0)
    coeff = 1.0 / (10.0 + 1e-6)  # megatron's rule: max_norm / (total_norm + 1e-6) when < 1
    torch.testing.assert_close(params[0].grad, torch.tensor([3.0, 0.0, 4.0]) * coeff)
    optimizer.clip_grad_by_total_norm_fp32(params, max_norm=100.0, total_norm=10.0)  # >= 1: unchanged
    torch.testing.assert_close(params[1].grad, torch.tensor([1.0, 2.0]) * coeff)


class _Group:
    """The two methods megatron's rope code calls on a ProcessGroup."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("embedding", ["rotary_pos_embedding", "yarn_rotary_pos_embedding"])
def test_7_rotary_table_split_for_context_parallelism(bridges, embedding):
    import importlib

    from megatron.core.models.common.embeddings import rope_utils

    rotary_pos_embedding = importlib.import_module(f"megatron.core.models.common.embeddings.{embedding}")

    table = torch.arange(8.0).view(8, 1, 1, 1)  # [seq, 1, 1, dim]
    with pytest.raises((RuntimeError, AssertionError)):  # pin_memory / .cuda() without CUDA
        rope_utils.get_pos_emb_on_this_cp_rank(table, 0, _Group(2, 1))
    cpu_compat.enable_cpu_megatron()
    local = rotary_pos_embedding.get_pos_emb_on_this_cp_rank(table, 0, _Group(2, 1))
    assert local.flatten().tolist() == [2.0, 3.0, 4.0, 5.0]  # chunks 1 and 2 of 4: megatron's order
    assert torch.equal(local, split_sequence(table, 2, 1, seq_dim=0))


def _bf16_optimizer():
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    weight = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16))
    bias = torch.nn.Parameter(torch.randn(3))  # an fp32 parameter beside it
    adam = torch.optim.Adam([weight, bias], lr=0.1)
    config = OptimizerConfig(optimizer="adam", lr=0.1, bf16=True, params_dtype=torch.bfloat16)
    return weight, bias, Float16OptimizerWithFloat16Params(adam, config, None, None)


def test_8_mixed_precision_optimizer_takes_cpu_parameters(bridges):
    for bridge in cpu_compat.BRIDGES:  # every bridge but this one (bridge 4 allocates its scale tensors)
        if bridge is not cpu_compat._cpu_tensors_pass_optimizer_type_checks:
            bridge()
    with pytest.raises(TypeError, match="Received torch.BFloat16Tensor"):
        _bf16_optimizer()
    cpu_compat.disable_cpu_megatron()
    cpu_compat.enable_cpu_megatron()
    weight, bias, optimizer = _bf16_optimizer()
    # the bf16 weight got an fp32 main copy in the inner optimizer, the fp32 bias is stepped as it is
    assert weight.main_param.dtype == torch.float32 and torch.equal(weight.main_param, weight.float())
    assert optimizer.optimizer.param_groups[0]["params"] == [weight.main_param, bias]
    assert torch.randn(2).type() == "torch.FloatTensor"  # only during the constructor


def _moe_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    values = dict(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=4, moe_router_topk=2)
    values.update(overrides)
    return TransformerConfig(use_cpu_initialization=True, moe_token_dispatcher_type="alltoall", **values)


def test_9_alltoall_dispatcher_without_cuda_streams(bridges):
    import types

    import numpy as np
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    config = _moe_config()
    groups = types.SimpleNamespace(ep=None, expt_tp=None, tp_ep=None)  # no process groups: one rank
    with pytest.raises(RuntimeError, match="CUDA"):  # torch.cuda.Stream() in __init__
        MoEAlltoAllTokenDispatcher(4, [0, 1, 2, 3], config, pg_collection=groups)
    cpu_compat.enable_cpu_megatron()
    dispatcher = MoEAlltoAllTokenDispatcher(4, [0, 1, 2, 3], config, pg_collection=groups)
    # The split sizes the EP all-to-all and the ETP all-gather read: numpy after the DtoH point (as
    # megatron's GPU path hands them on); the token counts come back untouched.
    dispatcher.input_splits, dispatcher.output_splits = torch.tensor([3, 1]), torch.tensor([2, 2])
    dispatcher.output_splits_tp = torch.tensor([4])
    counts = torch.tensor([1, 2, 0, 1])
    assert dispatcher._maybe_dtoh_and_synchronize("before_finish", counts) is counts  # not the DtoH point
    assert torch.is_tensor(dispatcher.input_splits)
    assert dispatcher._maybe_dtoh_and_synchronize(dispatcher.cuda_dtoh_point, counts) is counts
    for splits, expected in ((dispatcher.input_splits, [3, 1]), (dispatcher.output_splits, [2, 2])):
        assert isinstance(splits, np.ndarray) and splits.tolist() == expected
    assert dispatcher.output_splits_tp.tolist() == [4]


def _hybrid_optimizer_steps(weights: torch.Tensor, grads: list[torch.Tensor], offload_fraction: float) -> torch.Tensor:
    """megatron's HybridDeviceOptimizer as ``get_megatron_optimizer`` builds it (torch AdamW on both sides,
    fp32 updates, no pinned memory here), stepped once per gradient; the weights after."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    params = [torch.nn.Parameter(w.clone()) for w in weights]  # a bf16 ``weights``: fp32 copies are stepped
    optimizer = HybridDeviceOptimizer(
        [{"params": params}],
        offload_fraction=offload_fraction,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        param_update_in_fp32=True,
        pin_cpu_grads=False,
        pin_cpu_params=False,
        overlap_cpu_optimizer_d2h_h2d=False,  # OptimizerConfig's default
        lr=0.1,
        weight_decay=0.01,
    )
    for grad in grads:
        for param, g in zip(params, grad, strict=True):
            param.grad = g.clone().to(param.dtype)
        optimizer.step()
    return torch.stack([p.detach() for p in params])


def test_11_hybrid_optimizer_offloads_on_cpu(bridges):
    """Without the bridge every CPU parameter counts as already on the host, with no host copy in the
    optimizer's maps: KeyError at the first step. With it, all (fraction 1) or some (0.5) of the
    parameters are stepped on host copies and copied back: the weights equal torch's own AdamW."""
    torch.manual_seed(0)
    weights = torch.randn(4, 6)
    grads = [torch.randn(4, 6) for _ in range(3)]
    cpu_compat._cuda_sync_noops()  # bridge 5 alone (torch.cuda.current_stream): the step is reached
    with pytest.raises(KeyError):
        _hybrid_optimizer_steps(weights, grads, offload_fraction=1.0)
    cpu_compat.disable_cpu_megatron()
    cpu_compat.enable_cpu_megatron()
    reference = [torch.nn.Parameter(w.clone()) for w in weights]
    adamw = torch.optim.AdamW(reference, lr=0.1, weight_decay=0.01)
    for grad in grads:
        for param, g in zip(reference, grad, strict=True):
            param.grad = g.clone()
        adamw.step()
    expected = torch.stack([p.detach() for p in reference])
    assert not torch.equal(expected, weights)
    for fraction in (1.0, 0.5):
        torch.testing.assert_close(_hybrid_optimizer_steps(weights, grads, fraction), expected, rtol=0, atol=1e-7)
    # bf16 parameters (the precision-aware optimizer hands it the bf16 shards): the fp32 copy of a host copy
    # stays on the host, as on a GPU machine, so the host optimizer steps it; the bf16 weights after equal
    # torch's AdamW on fp32 copies of them (bf16 gradients), rounded to bf16
    reference = [torch.nn.Parameter(w.to(torch.bfloat16).float()) for w in weights]
    adamw = torch.optim.AdamW(reference, lr=0.1, weight_decay=0.01)
    for grad in grads:
        for param, g in zip(reference, grad, strict=True):
            param.grad = g.to(torch.bfloat16).float()
        adamw.step()
    expected = torch.stack([p.detach() for p in reference]).to(torch.bfloat16)
    for fraction in (1.0, 0.5):
        got = _hybrid_optimizer_steps(weights.to(torch.bfloat16), grads, fraction)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_12_gated_delta_net_gets_the_torch_rule_where_fla_is_absent(bridges):
    """Keyed to the upstream import: the names megatron's gated DeltaNet imports from FLA (0.16-0.18:
    ``ssm/gated_delta_net.py``; 0.19: ``ssm/gated_delta_net/common.py``, bound again in ``gdn.py``) are ones the
    bridge supplies; without it the layer refuses to build, with it megatron's FLA call sites
    (``chunk_gated_delta_rule(q, k, v, g=, beta=, initial_state=, output_final_state=,
    use_qk_l2norm_in_kernel=)``; 0.19's ``causal_conv1d(x=, weight=, bias=, activation=, ...)``) give what
    megatron's own torch path (its ``deterministic_mode``) gives."""
    package = pytest.importorskip("megatron.core.ssm.gated_delta_net")
    if package.HAVE_FLA:
        pytest.skip("flash-linear-attention is installed: megatron uses it and the bridge patches nothing")
    modules = cpu_compat.gated_delta_net_modules()
    imported = set().union(*(cpu_compat.names_imported_from_fla(module) for module in modules))
    assert imported and imported <= set(cpu_compat.GATED_DELTA_NET_FLA_NAMES), imported
    with pytest.raises(ImportError, match="FLA is not installed"):
        package.GatedDeltaNet(config=None, submodules=None)
    assert getattr(package, "l2norm", None) is None and package.chunk_gated_delta_rule is None
    cpu_compat.enable_cpu_megatron()
    assert all(module.HAVE_FLA is True for module in modules if hasattr(module, "HAVE_FLA"))
    generator = torch.Generator().manual_seed(0)
    q, k = (package.l2norm(torch.randn(2, 70, 3, 4, generator=generator)) for _ in range(2))
    v = torch.randn(2, 70, 3, 5, generator=generator)
    g = -torch.rand(2, 70, 3, generator=generator)
    beta = torch.rand(2, 70, 3, generator=generator)
    call = dict(g=g, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False)
    for module in modules:  # every binding megatron calls through
        if "chunk_gated_delta_rule" in vars(module):
            bridged, _ = module.chunk_gated_delta_rule(q, k, v, **call)
            megatrons, _ = package.torch_chunk_gated_delta_rule(q, k, v, **call)
            torch.testing.assert_close(bridged, megatrons, rtol=1e-4, atol=1e-5)
        if "causal_conv1d" in vars(module):  # 0.19: its deterministic path is torch's F.conv1d, sliced causal
            x, weight, bias = torch.randn(2, 9, 6), torch.randn(6, 4), torch.randn(6)
            bridged, _ = module.causal_conv1d(x=x, weight=weight, bias=bias, activation="silu", cu_seqlens=None)
            conv = torch.nn.functional.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=3, groups=6)
            torch.testing.assert_close(bridged, torch.nn.functional.silu(conv[..., :9]).transpose(1, 2))
    cpu_compat.disable_cpu_megatron()
    assert package.HAVE_FLA is False and package.chunk_gated_delta_rule is None
    assert getattr(package, "l2norm", None) is None  # never defined upstream without FLA (0.16) or None (0.19)
