"""This rank's trainable model as megatron wants it: DDP-wrapped chunks, one per virtual pipeline stage.

Design decisions:
- ``ModelChunks`` is a list of megatron ``DistributedDataParallel`` wrappers, in chunk order (one without
  virtual stages, ``parallel.vpp`` with them): megatron's schedule, optimizer and grad finalisation take
  that list as it is. What the trainer does to "the model" (zero, free and restore gradient buffers,
  parameters, checkpoint state) is done here to every chunk, so no caller loops over chunks itself.
- Parameter names follow ``policy/models/conversion.py``: megatron's own with one chunk, ``chunk{c}.`` before
  them with several (each chunk numbers its layers from 0).
- Checkpoint state follows Megatron-LM's ``generate_state_dict``: key ``model`` with one chunk,
  ``model0``, ``model1``, ... with several. The sharded tensors inside carry global layer numbers
  (megatron offsets each chunk's layers), so a checkpoint resumes under any vpp.
- ``release`` lets a closed run's chunks be freed. megatron's MoE token dispatchers keep the last
  forward's routing probabilities (``probs``) with their autograd graph; that graph reaches the
  parameters' gradient accumulators, whose hooks (DDP's) hold the DDP wrapper, which holds the model:
  a cycle through C++ autograd nodes that Python's gc cannot see into. Uncut, every run in a process
  (a Hydra multirun, a test session) kept its model, gradient buffers and process groups (16 gloo
  groups, 48 threads, on the main job) alive for good. megatron's ``RotaryEmbedding.forward`` is an
  ``lru_cache`` keyed on the module, which holds the context-parallel group; its entries go too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from gspo_megatron.policy.models.conversion import chunk_prefix, unwrap

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel


class ModelChunks(list):
    """megatron DDP wrappers of this rank's model chunks, in virtual-stage order."""

    @property
    def models(self) -> list:
        """The unwrapped GPTModel chunks."""
        return [unwrap(chunk) for chunk in self]

    @property
    def config(self):
        """The TransformerConfig the chunks share."""
        return self[0].config

    @property
    def ddp_config(self):
        return self[0].ddp_config

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for chunk in self:
            yield from chunk.parameters()

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Every chunk's parameters under the conversion's names (``chunk{c}.`` with several chunks)."""
        for index, module in enumerate(self.models):
            prefix = chunk_prefix(index, len(self))
            for name, param in module.named_parameters():
                yield prefix + name, param

    def zero_grad_buffer(self) -> None:
        for chunk in self:
            chunk.zero_grad_buffer()

    def offload_grad_buffers(self, **kwargs) -> None:
        for chunk in self:
            chunk.offload_grad_buffers(**kwargs)

    def restore_grad_buffers(self, **kwargs) -> None:
        for chunk in self:
            chunk.restore_grad_buffers(**kwargs)

    def release(self) -> None:
        """Drop what keeps the chunks alive past their run (module docstring): every tensor attribute of
        a MoE token dispatcher that carries an autograd graph, and megatron's rotary-embedding cache."""
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        for chunk in self:
            for module in chunk.modules():
                dispatcher = getattr(module, "token_dispatcher", None)
                if dispatcher is None:
                    continue
                for name, value in list(vars(dispatcher).items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(dispatcher, name, None)
        RotaryEmbedding.forward.cache_clear()

    def grad_buffers(self) -> list[torch.Tensor]:
        """This rank's gradient storage: every chunk's contiguous buffers (dense and expert)."""
        return [buffer.grad_data for chunk in self for buffer in chunk.buffers + chunk.expert_parallel_buffers]

    def state_keys(self) -> list[str]:
        """Checkpoint keys of the chunks' state (module docstring)."""
        return ["model"] if len(self) == 1 else [f"model{index}" for index in range(len(self))]

    def sharded_state_dict(self) -> dict[str, Any]:
        """{state key: the chunk's sharded state dict} (dist_checkpointing's form)."""
        return {key: module.sharded_state_dict() for key, module in zip(self.state_keys(), self.models, strict=True)}

    def load_state_dict(self, loaded: dict[str, Any]) -> None:
        for key, module in zip(self.state_keys(), self.models, strict=True):
            module.load_state_dict(loaded[key])


def as_model_chunks(model: DistributedDataParallel | list) -> ModelChunks:
    """A DDP-wrapped model, or a list of them, as ``ModelChunks``."""
    return model if isinstance(model, ModelChunks) else ModelChunks(model if isinstance(model, list) else [model])
