"""megatron's @jit_fuser kernels compile on first call: no dynamo at import, same results when called."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.core.deferred_compile import deferring_compile
from gspo_megatron.testing.fresh_interpreter import run_in_fresh_interpreter


def test_a_deferred_function_compiles_once_on_its_first_call():
    compiled_functions = []

    def real_compile(model, **options):  # torch.compile itself, counting its calls
        compiled_functions.append(model.__name__)
        return torch.compile(model, **options)

    @deferring_compile(real_compile)(backend="eager")
    def scaled_silu(x, scale: float):
        return torch.nn.functional.silu(x) * scale

    assert compiled_functions == [] and scaled_silu.__name__ == "scaled_silu"
    x = torch.linspace(-3, 3, 7)
    torch.testing.assert_close(scaled_silu(x, 2.0), torch.nn.functional.silu(x) * 2.0)
    torch.testing.assert_close(scaled_silu(x, 0.5), torch.nn.functional.silu(x) * 0.5)
    assert compiled_functions == ["scaled_silu"]


@pytest.mark.slow
def test_importing_megatron_through_the_package_imports_no_dynamo():
    probe = (
        "import sys, torch, gspo_megatron\n"
        "import megatron.core, megatron.core.jit as jit\n"
        "from megatron.core.models.gpt import gpt_layer_specs\n"
        "from megatron.core.optimizer import get_megatron_optimizer\n"
        "assert torch.compile.__module__.startswith('torch'), torch.compile  # torch's own again\n"
        "assert jit.jit_fuser is not torch.compile\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))\n"
    )
    printed = run_in_fresh_interpreter(probe)
    assert printed == "[]", printed
