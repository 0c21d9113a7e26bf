"""What the test ranks' fork server imports once, so that no rank pays for it (testing/distributed.py).

Third-party modules only, after the package's own ``__init__`` (its import hooks shape megatron's
import), which is the order a spawned rank imports them in: its entry point lives in this package. So a
forked rank starts from the state a spawned one reaches by importing; the package's own modules (the
CPU bridges, the trainer, the test's own modules) its own imports install, as in a spawned rank.
- torch and megatron-core: what every rank imports (5-12 s on a loaded 2-core machine).
- What a training run imports besides (``testing.train_runs.train_worker``; measured with cProfile on
  the tiny job, 8.3 s of its 11.9): transformers' Qwen3-MoE (the embedded engine, 2.7 s), torch's
  dynamo and inductor (the first ``@jit_fuser`` call and torch's optimizers, 1.3 s) and matplotlib on
  Agg (the run's charts, 0.5 s). None starts a thread of its own; numpy's BLAS pool, which
  transformers' import brings, re-forms itself after a fork (OpenBLAS's ``pthread_atfork``).
Megatron-core's import-time warnings about absent TransformerEngine/Apex are silenced here (they are
printed once per run by the package itself, gspo_megatron/core/known_warnings.py).
"""

import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import matplotlib
    import matplotlib.backends.backend_agg
    import matplotlib.figure
    import megatron.core.dist_checkpointing
    import megatron.core.distributed
    import megatron.core.models.gpt
    import megatron.core.optimizer
    import megatron.core.parallel_state
    import megatron.core.transformer.moe.moe_layer  # noqa: F401
    import torch
    import torch._dynamo
    import torch._inductor.compile_fx
    import torch.distributed  # noqa: F401
    import transformers.cache_utils
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401

    matplotlib.use("Agg")  # as the run's charts do (run/run_log.py), before pyplot picks a backend
    import matplotlib.pyplot
