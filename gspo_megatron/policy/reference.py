"""The frozen reference policy of the KL term (``algorithm.kl.coef > 0``): a second model, same layout.

Design decisions:
- Built only when ``algorithm.kl.coef > 0``; with coefficient 0 nothing is built and no reference
  forward runs (the trainer holds ``None``).
- Weights: the policy's *initial* weights (the same source the policy was loaded from -- its HF
  checkpoint or the seeded random init -- so a resumed run keeps the same reference), or the HF
  checkpoint ``algorithm.kl.reference``. Loaded with the policy's own sharding code, so every layout
  (TP/PP/EP/CP) evaluates it exactly like the policy.
- Its routers are built without megatron's ``RouterReplay`` (``moe_enable_routing_replay=False``):
  megatron keeps RouterReplay instances in one process-global list, and a second model that added
  its own would either shift what "global" record/replay calls touch or consume the policy's replay
  targets. Without an instance a router cannot record or replay, whatever the policy's replay mode
  (R2/R3); the reference always routes freely, as the reference policy would on its own.
- Frozen: no DDP wrapper, no optimizer, parameters ``requires_grad=False``, forward-only passes.
- Memory (per rank): one extra copy of this rank's parameter shard in ``model.dtype`` (4 bytes per
  parameter in fp32, 2 in bf16) -- no gradients, no optimizer state; the policy itself holds params +
  fp32 grads + two Adam moments (16 bytes per parameter with fp32 params), so the reference adds
  ~25% of the policy's static memory at fp32 (~12.5% with bf16 params and fp32 optimizer state,
  master weights included). Activations of its forward-only pass are transient, the same size as the
  old-log-prob pass's.
- ``trainer.reference_offload``: the weights live in pinned host memory between passes and come to the
  device for each reference pass (``policy/host_weights.py``: one transfer per RL step). Chosen over
  slime's way (one model; the reference weights swapped into the policy's parameters for the pass and
  the policy's swapped out and back) because the policy's routers carry RouterReplay state (R2/R3)
  that the reference must neither consume nor use (above), and because a swap moves the policy's
  weights twice per step besides the reference's once. The cost: during the reference pass the
  device holds the reference's weights beside the policy's (the planner counts them in that phase,
  ``tools/planning/rl_step_memory.py``), which is below the update's peak whenever the training
  activations are larger than one forward-only layer and the weights of a stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gspo_megatron.contracts.micro_batch import MicroBatch
from gspo_megatron.policy.host_weights import HostResidentWeights
from gspo_megatron.policy.loss_heads import LogProbHead
from gspo_megatron.policy.models.builder import build_model_chunks
from gspo_megatron.policy.models.conversion import load_hf_weights
from gspo_megatron.policy.models.schedule import run_schedule
from gspo_megatron.policy.models.weight_sources import SafetensorsSource

if TYPE_CHECKING:
    from gspo_megatron.policy.config import ModelSection
    from gspo_megatron.policy.models.weight_sources import WeightSource
    from gspo_megatron.policy.parallel.layout import ParallelLayout
    from gspo_megatron.policy.parallel.mesh import ParallelMesh


class ReferenceModel:
    """A frozen GPTModel stage (its chunks, under virtual pipeline stages) whose routers have no RouterReplay;
    returns the log-probs of micro-batches (``log_probs``), which the updates' micro-batches carry."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        tp_group: dist.ProcessGroup | None,
        temperature: float,
        chunk_size: int | None,
        *,
        row_parts_group: dist.ProcessGroup | None,
        offload: bool = False,
    ):
        """``offload``: keep the weights in host memory between passes (``trainer.reference_offload``);
        ``row_parts_group``: the ranks holding parts of each row (``ParallelMesh.row_parts_group``)."""
        self.chunks = list(chunks)
        modules = torch.nn.ModuleList(self.chunks)  # every chunk's parameters as one module's

        # under context parallelism the head gathers each rank's share back into whole rows
        self.head = LogProbHead(tp_group, temperature, chunk_size, cp_group=row_parts_group)
        modules.eval()
        for param in modules.parameters():
            param.requires_grad_(False)
        self.host_weights = HostResidentWeights(modules) if offload else None

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """Every chunk's (frozen) parameters."""
        for chunk in self.chunks:
            yield from chunk.parameters()

    @classmethod
    def build(
        cls,
        model_cfg: ModelSection,
        layout: ParallelLayout,
        mesh: ParallelMesh,
        policy_source: WeightSource | Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        *,
        kl_reference: str | None,
        temperature: float,
        chunk_size: int | None,
        offload: bool,
    ) -> ReferenceModel:
        """``policy_source``: where the policy's initial weights came from, the reference's unless
        ``kl_reference`` (``algorithm.kl.reference``, a HF checkpoint) names its own."""
        source = SafetensorsSource(kl_reference) if kl_reference else policy_source
        chunks = build_model_chunks(
            model_cfg,
            layout,
            params_dtype=dtype,
            layer_spec=model_cfg.layer_spec,
            token_dispatcher=model_cfg.token_dispatcher,
            expert_mlp=model_cfg.expert_mlp,
            routing_replay=False,
            initialize=False,
        )
        load_hf_weights(chunks, model_cfg, source, mesh)
        return cls(
            chunks, mesh.tp_group, temperature, chunk_size, row_parts_group=mesh.row_parts_group, offload=offload
        )

    def log_probs(self, micro_batches: Sequence[MicroBatch]) -> list[torch.Tensor]:
        """Forward every micro-batch through the reference; on the last pipeline stage (where the loss
        head runs) the log-probs of each [b, s], in order; an empty list on the other stages. Collective
        over the stage group."""
        on_device = self.host_weights.on_device() if self.host_weights is not None else contextlib.nullcontext()
        with torch.no_grad(), on_device:
            outputs = run_schedule(self.chunks, micro_batches, self.head, forward_only=True)
        if outputs and len(outputs) != len(micro_batches):
            raise RuntimeError(f"reference pass returned {len(outputs)} outputs for {len(micro_batches)} micro-batches")
        return [out.log_probs for out in outputs]
