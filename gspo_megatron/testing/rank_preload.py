"""What the test ranks' fork server imports once, so that no rank pays for it (testing/distributed.py).

Only torch and megatron-core, after the package's own ``__init__`` (its import hooks shape megatron's
import), which is the order a spawned rank imports them in: its entry point lives in this package. So a
forked rank starts from the state a spawned one reaches by importing; everything else (the CPU bridges,
the test's own modules) its own imports install, as in a spawned rank. Megatron-core's import-time
warnings about absent TransformerEngine/Apex are silenced here (they are printed once per run by the
package itself, gspo_megatron/known_warnings.py).
"""

import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import megatron.core.dist_checkpointing
    import megatron.core.distributed
    import megatron.core.models.gpt
    import megatron.core.optimizer
    import megatron.core.parallel_state
    import megatron.core.transformer.moe.moe_layer  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401
