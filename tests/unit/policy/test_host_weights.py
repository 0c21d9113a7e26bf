"""HostResidentWeights: parameters in flat host buffers, brought in for a pass, values and shared storages kept."""

from __future__ import annotations

import torch

from gspo_megatron.policy.host_weights import HostResidentWeights
from gspo_megatron.policy.models.grouped_experts import share_one_storage, stacked_weights


class _Expert(torch.nn.Module):
    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.fc1 = torch.nn.Parameter(torch.randn(4, 3, generator=generator))
        self.fc2 = torch.nn.Parameter(torch.randn(3, 2, generator=generator))


class _Experts(torch.nn.Module):
    """Three experts registered as SequentialMLP's (fc1 and fc2 of expert 0, then of expert 1, ...),
    each projection's weights views of one [E, out, in] storage (as the grouped experts), a bias in
    another dtype, and a parameter registered twice."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.experts = torch.nn.ModuleList([_Expert(generator) for _ in range(3)])
        self.bias = torch.nn.Parameter(torch.randn(5, generator=generator, dtype=torch.float64))
        self.alias = self.bias
        share_one_storage([expert.fc1 for expert in self.experts])
        share_one_storage([expert.fc2 for expert in self.experts])

    @property
    def fc1(self) -> list[torch.nn.Parameter]:
        return [expert.fc1 for expert in self.experts]

    @property
    def fc2(self) -> list[torch.nn.Parameter]:
        return [expert.fc2 for expert in self.experts]


def _values(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def test_parameters_keep_their_values_and_shared_storages_in_host_buffers():
    module = _Experts()
    before = _values(module)
    host = HostResidentWeights(module)
    # each dtype once, each parameter once: 3 * 12 + 3 * 6 float32 elements, 5 float64
    assert {dtype: flat.numel() for dtype, flat in host.host.items()} == {torch.float32: 54, torch.float64: 5}
    assert host.nbytes == 54 * 4 + 5 * 8
    for name, p in module.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.untyped_storage().data_ptr() == host.host[p.dtype].untyped_storage().data_ptr(), name
    for projection in (module.fc1, module.fc2):
        weights = tuple(projection)
        stacked = stacked_weights(weights)
        # still back to back in expert order: the grouped GEMM's operand is a view, not a copy
        assert stacked.untyped_storage().data_ptr() == weights[0].untyped_storage().data_ptr()
        assert torch.equal(stacked, torch.stack([w.detach() for w in weights]))


def test_on_device_gives_the_same_forward_and_returns_the_parameters_to_host():
    module = _Experts()
    host = HostResidentWeights(module)
    x = torch.randn(7, 3, generator=torch.Generator().manual_seed(1))
    expected = torch.cat([x @ w.T for w in module.fc1], dim=1)
    with host.on_device():
        for p in module.parameters():
            assert p.device == host.device
        inside = torch.cat([x.to(host.device) @ w.T for w in module.fc1], dim=1).cpu()
    assert torch.equal(inside, expected)
    for p in module.parameters():  # between passes: the host buffers again
        assert p.untyped_storage().data_ptr() == host.host[p.dtype].untyped_storage().data_ptr()
