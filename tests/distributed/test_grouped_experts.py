"""``GroupedExperts`` against megatron's ``SequentialMLP`` on the very same module (its parent's
``forward`` on the same parameters): forward, and gradients of the rows, the routing probabilities and
every expert weight, for token counts with idle experts, one busy expert and no rows at all; bf16 (whose expert groups
are padded on CPU);
widths ``torch._grouped_mm`` cannot take (SequentialMLP's loop runs instead). Built in a spawned rank
(megatron's parallel state never touches the test process). Also: what autograd keeps for backward
(bytes of saved tensors other than the parameters) is no more than SequentialMLP keeps."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from gspo_megatron.testing.distributed import run_distributed
from gspo_megatron.testing.model_fixtures import tiny_test_config

COUNTS = {"idle_experts": [5, 0, 9, 2], "one_expert": [0, 0, 13, 0], "no_rows": [0, 0, 0, 0]}


def _experts_of(cfg, dtype, expert_mlp):
    from gspo_megatron.policy.models.builder import build_model

    model = build_model(cfg, _layout(cfg), params_dtype=dtype, expert_mlp=expert_mlp)
    return model, model.decoder.layers[0].mlp.experts


def _layout(cfg):
    from gspo_megatron.policy.parallel.layout import ParallelLayout

    return ParallelLayout(world_size=1).validate(cfg)


def _run(experts, rows, counts, probs, forward):
    rows, probs = rows.clone().requires_grad_(), probs.clone().requires_grad_()
    for param in experts.parameters():
        param.grad = None
    out, bias = forward(rows, torch.tensor(counts), probs)
    assert bias is None
    out_grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    (out * out_grad).sum().backward()
    grads = {name: p.grad.clone() for name, p in experts.named_parameters() if p.grad is not None}
    return out.detach(), rows.grad, probs.grad, grads


def _saved_bytes(experts, forward, rows, counts, probs) -> int:
    """Bytes of the storages autograd saves for backward during ``forward``, parameters excluded."""
    parameters = {p.untyped_storage().data_ptr() for p in experts.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward(rows.clone().requires_grad_(), torch.tensor(counts), probs.clone().requires_grad_())
    return sum(saved.values())


def _te_grouped_names_map_alike(model, cfg) -> bool:
    """HF conversion of TEGroupedMLP's ``linear_fc{1,2}.weight{i}`` (the TE spec's grouped experts)
    equals that of expert i's SequentialMLP/GroupedExperts parameter, but for the megatron name."""
    from dataclasses import replace

    from gspo_megatron.policy.models.conversion import _mapping_for, build_mappings

    rows = build_mappings(model, cfg)
    prefix = "decoder.layers.{}.mlp.experts."
    checked = 0
    for row in rows:
        parts = row.megatron_name.split(".")
        if "local_experts" not in parts:
            continue
        layer, index, which = parts[2], parts[6], parts[7]
        te_name = prefix.format(layer) + f"{which}.weight{index}"
        te_row = _mapping_for(model, te_name, cfg, 0)
        if replace(te_row, megatron_name=row.megatron_name) != row:
            return False
        checked += 1
    return checked == 2 * cfg.num_experts * cfg.num_layers


def _one_storage_views(experts) -> dict:
    """Whether the grouped GEMMs see each projection's weights as a view (no copy), and after the
    parameters are moved apart (as megatron's distributed-optimizer buffer does) as an equal copy."""
    from gspo_megatron.policy.models.grouped_experts import stacked_weights

    fc1 = tuple(expert.linear_fc1.weight for expert in experts.local_experts)
    fc2 = tuple(expert.linear_fc2.weight for expert in experts.local_experts)
    views = [stacked_weights(w).data_ptr() == w[0].data_ptr() for w in (fc1, fc2)]
    expected = torch.stack([w.detach().clone() for w in fc1])
    for weight in fc1:
        weight.data = weight.data.clone()  # each in its own storage now
    moved = stacked_weights(fc1)
    return {
        "views": views,
        "moved_is_copy": moved.data_ptr() != fc1[0].data_ptr(),
        "moved_equal": torch.equal(moved, expected),
    }


def compare_worker(ctx, cfg, dtype: torch.dtype) -> dict:
    from megatron.core.transformer.moe.experts import SequentialMLP

    from gspo_megatron.policy.cpu_bridges import apply_cpu_bridges
    from gspo_megatron.policy.models.grouped_experts import GroupedExperts
    from gspo_megatron.policy.parallel.mesh import initialize_parallel

    apply_cpu_bridges()
    mesh = initialize_parallel(_layout(cfg), seed=3)
    sequential_model, _ = _experts_of(cfg, dtype, "sequential")
    model, experts = _experts_of(cfg, dtype, "grouped")
    out: dict = {
        "type": type(experts).__name__,
        "same_names": [k for k, _ in model.named_parameters()] == [k for k, _ in sequential_model.named_parameters()],
        "same_state_dict_keys": model.state_dict().keys() == sequential_model.state_dict().keys(),
    }
    generator = torch.Generator().manual_seed(0)
    for param in experts.parameters():  # weights with spread, like a trained layer
        param.data.copy_(0.2 * torch.randn(param.shape, generator=generator))
    for case, counts in COUNTS.items():
        rows = torch.randn(sum(counts), cfg.hidden_size, generator=generator).to(dtype)
        probs = torch.rand(sum(counts), generator=generator)  # megatron's router dtype: fp32
        with mock.patch.object(torch, "_grouped_mm", wraps=torch._grouped_mm) as grouped_mm:
            grouped = _run(experts, rows, counts, probs, experts.forward)
        reference = _run(experts, rows, counts, probs, lambda *a: SequentialMLP.forward(experts, *a))
        out[case] = {"grouped": grouped, "sequential": reference, "grouped_mm_calls": grouped_mm.call_count}
        out[case]["saved_bytes"] = {
            "grouped": _saved_bytes(experts, experts.forward, rows, counts, probs),
            "sequential": _saved_bytes(experts, lambda *a: SequentialMLP.forward(experts, *a), rows, counts, probs),
        }
    out["is_grouped"] = isinstance(experts, GroupedExperts)
    out["one_storage"] = _one_storage_views(experts)
    out["te_names_map_alike"] = _te_grouped_names_map_alike(model, cfg)
    mesh.destroy()
    return out


def _assert_same(result, case, tol):
    grouped, sequential = result[case]["grouped"], result[case]["sequential"]
    for got, expected in zip(grouped[:3], sequential[:3], strict=True):
        torch.testing.assert_close(got, expected, **tol)
    assert grouped[3].keys() == sequential[3].keys()
    for name, grad in sequential[3].items():
        torch.testing.assert_close(grouped[3][name], grad, **tol, msg=lambda m, name=name: f"{name}: {m}")


def _padded(rows: int, dtype: torch.dtype) -> int:
    """An expert's rows in the grouped GEMMs: bf16/fp16 on CPU pad them to ``CPU_ROW_MULTIPLE``."""
    from gspo_megatron.policy.models.grouped_experts import group_row_multiple

    multiple = group_row_multiple(dtype, torch.device("cpu"))
    return -(-rows // multiple) * multiple


@pytest.mark.parametrize(
    "dtype, tol",
    [(torch.float32, dict(rtol=1e-5, atol=1e-5)), (torch.bfloat16, dict(rtol=1.6e-2, atol=1e-2))],
    ids=["fp32", "bf16"],
)
def test_grouped_experts_equal_sequential_mlp(dtype, tol):
    cfg = tiny_test_config()
    (result,) = run_distributed(compare_worker, 1, cfg, dtype, timeout=300)
    assert result["type"] == "GroupedExperts" and result["is_grouped"]
    assert result["same_names"] and result["same_state_dict_keys"]
    assert result["te_names_map_alike"]
    for case in COUNTS:
        _assert_same(result, case, tol)
        saved = result[case]["saved_bytes"]
        offsets = 4 * len(COUNTS[case])  # the int32 end offsets of the experts' rows
        rows, padded = sum(COUNTS[case]), sum(_padded(n, dtype) for n in COUNTS[case])
        per_row = saved["sequential"] / rows if rows else 0
        # no stacked weight copy kept; bf16 on CPU keeps its padded rows (and their int64 positions)
        assert saved["grouped"] <= per_row * padded + offsets + 8 * rows, (case, saved)
        # fc1 and fc2 over all experts at once; backward: their row and weight gradients
        assert result[case]["grouped_mm_calls"] == 2 + 4, case
    assert result["idle_experts"]["grouped"][3]["local_experts.1.linear_fc1.weight"].abs().max() == 0
    # the GEMMs above ran on the one-storage views; moved weights are stacked into an equal copy
    assert result["one_storage"] == {"views": [True, True], "moved_is_copy": True, "moved_equal": True}


def test_widths_grouped_mm_refuses_run_sequential_mlps_loop():
    # moe_intermediate_size 6: the fc2 input rows are 24 bytes, not a multiple of 16
    cfg = tiny_test_config(moe_intermediate_size=6)
    (result,) = run_distributed(compare_worker, 1, cfg, torch.float32, timeout=300)
    for case in COUNTS:
        assert result[case]["grouped_mm_calls"] == 0, case
        _assert_same(result, case, dict(rtol=0, atol=0))
