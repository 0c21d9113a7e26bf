"""megatron-core's ``@jit_fuser`` functions compiled on first call, not at import (start-up time).

megatron-core 0.16 binds ``megatron.core.jit.jit_fuser = torch.compile`` and decorates dozens of fused
kernels with it at import; the first decoration imports torch's dynamo and inductor (about 2 s on
2 cores), although with the fusions this project turns off (``policy/models/builder.py``) most of them are
never called. Deferred, the import happens only if one is called: tools and tests that import
megatron without running a MoE forward never pay it. megatron's router calls the ``@jit_fuser``
function ``TopKRouter._apply_expert_bias`` on every forward; where expert bias is off (a no-op) the model
builder binds it uncompiled (``policy/models/idle_expert_bias.py``), so only expert-bias models compile it.
torch's optimizers import dynamo in ``add_param_group`` anyway.

Design decisions:
- While ``megatron.core.jit`` itself executes, ``torch.compile`` is a deferring stand-in, so
  ``jit_fuser`` captures it; afterwards ``torch.compile`` is torch's own again for everyone else.
- The stand-in returns a function that calls the real ``torch.compile`` with the same arguments on
  its first call and the compiled function from then on: what runs, and when compilation happens
  (the first call, as with torch.compile itself), is unchanged; only the dynamo import moves.
  Anything that is not a plain function (a module) is compiled at once, as before.
- Installed once, from ``gspo_megatron/__init__.py``, as a meta-path finder for that one module
  (``core/import_hooks.py``), so every way into megatron (trainer, tools, tests, spawned ranks) behaves
  the same; it imports nothing until megatron is imported (reward workers never import torch).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from gspo_megatron.core.import_hooks import import_within

MEGATRON_JIT_MODULE = "megatron.core.jit"


def deferring_compile(real_compile: Callable[..., Any]) -> Callable[..., Any]:
    """A ``torch.compile`` look-alike that compiles a function on its first call."""

    def compile_later(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as ``@torch.compile(...)``
            return lambda function: compile_later(function, **options)
        if not inspect.isfunction(model):
            return real_compile(model, **options)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    return compile_later


@contextmanager
def _torch_compile_deferred() -> Iterator[None]:
    import torch  # megatron.core has imported it already

    real_compile = torch.compile
    torch.compile = deferring_compile(real_compile)
    try:
        yield
    finally:
        torch.compile = real_compile


def install() -> None:
    """Defer megatron's jit compilation (idempotent; no effect if megatron.core.jit is already loaded)."""
    import_within(MEGATRON_JIT_MODULE, _torch_compile_deferred)
