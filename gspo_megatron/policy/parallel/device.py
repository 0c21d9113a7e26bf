"""The one machine question the package asks: CUDA or not.

It picks kernels, never training behaviour: with CUDA, NCCL collectives and CUDA tensors; without,
gloo collectives, CPU tensors and megatron-core's CPU bridges (``policy/cpu_bridges.py``). The
optimizer, DDP, precision and dispatcher choices are config keys whose defaults are the same on both
(docs/cluster.md, "Where it has run"). TransformerEngine layers are the other kernel choice
(``policy/models/builder.py:transformer_engine_available``).
"""

from __future__ import annotations

import torch


def cuda_kernels() -> bool:
    """NCCL and CUDA tensors where a GPU is visible, gloo and CPU tensors elsewhere."""
    return torch.cuda.is_available()


def compute_device() -> torch.device:
    """Where this rank's weights and activations live (after ``torch.cuda.set_device`` on GPUs)."""
    return torch.device("cuda", torch.cuda.current_device()) if cuda_kernels() else torch.device("cpu")
