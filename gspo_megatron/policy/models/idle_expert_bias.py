"""Routers without expert bias call megatron's ``TopKRouter._apply_expert_bias`` uncompiled.

Every router forward calls ``_apply_expert_bias(routing_map, padding_mask)``, which megatron-core (0.16.1 and
0.19.2 alike) decorates with ``@jit_fuser``, i.e. ``torch.compile``. Its body is

    if self.enable_expert_bias and torch.is_grad_enabled():
        ... self.local_tokens_per_expert += routing_map.sum(dim=0)

so without expert bias (``model.expert_bias=false``: every family here but GLM-4.5's and DeepSeek-V3's
aux-loss-free balancing) it does nothing, yet its first call in a process traced it with dynamo, for an empty
graph: 0.3-0.4 s of CPU in each process that runs a MoE forward (a tiny 2-step run: 8.6-9.2 s against 9.2-9.6 s,
three alternated pairs; issue 65, found profiling the start-up of the tests' tiny runs). Such routers get the same
function uncompiled, bound to the instance: it does what the compiled one does (nothing), and dynamo is not
entered. A router with expert bias keeps megatron's compiled function.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Iterable

import torch


def run_idle_expert_bias_eagerly(chunks: Iterable[torch.nn.Module]) -> int:
    """Bind the uncompiled ``_apply_expert_bias`` to every router of ``chunks`` without expert bias; returns how
    many routers it bound (0 when megatron's function is not compiled, e.g. ``jit_fuser`` a no-op decorator)."""
    from megatron.core.transformer.moe.router import TopKRouter

    compiled = TopKRouter._apply_expert_bias
    plain = inspect.unwrap(compiled)
    if plain is compiled:
        return 0
    bound = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter) and not module.enable_expert_bias:
                module._apply_expert_bias = types.MethodType(plain, module)
                bound += 1
    return bound
