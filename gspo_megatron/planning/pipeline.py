"""Pipeline layouts beyond the trainer's even split: per-stage layer counts and virtual pipeline chunks.

Design decisions:
- ``PipelineLayout`` is a ``ParallelLayout`` with two more fields, for the planner only: the trainer
  builds an even split (``parallel.pp`` must divide ``model.num_layers``) and no virtual pipeline,
  and the planner says so for every plan of such a layout (``TRAINER_REFUSES``).
- Stage counts follow megatron's flags: ``first``/``last`` are the decoder layers of the first and
  last *virtual* stage (``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``),
  the others split the remaining layers evenly (refused if they do not divide). With ``vpp = v``
  rank r holds virtual stages r, r + pp, ..., r + (v - 1) pp (megatron's interleaved order).
- Interleaved 1F1B (Narayanan et al. 2021; megatron's ``theoretical_memory_usage.py``): the first
  stage keeps ``1 + (pp - 1) / (pp v)`` times the activations of plain 1F1B, and the bubble is
  ``(pp - 1) / v`` micro-batch slots instead of ``pp - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gspo_megatron.parallel.layout import LayoutError, ParallelLayout

TRAINER_REFUSES = (
    "the trainer builds an even pipeline split without virtual stages (parallel.pp must divide "
    "model.num_layers): this layout is planned, not runnable here"
)


@dataclass(frozen=True)
class PipelineLayout(ParallelLayout):
    vpp: int = 1  # virtual pipeline chunks per rank
    first: int | None = None  # decoder layers of the first virtual stage; None: even
    last: int | None = None  # decoder layers of the last virtual stage; None: even

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.vpp

    def layer_counts(self, num_layers: int) -> list[int]:
        """Decoder layers of each virtual stage, in model order; LayoutError if they do not split."""
        stages = self.virtual_stages
        fixed = [n for n in (self.first, self.last) if n is not None]
        middle = stages - len(fixed)
        rest = num_layers - sum(fixed)
        if any(n < 0 for n in fixed) or rest < 0 or (middle and rest % middle) or (not middle and rest):
            raise LayoutError(
                f"{num_layers} layers over {stages} virtual stages (pp {self.pp} x vpp {self.vpp}) with "
                f"first={self.first} last={self.last}: the other {middle} stages cannot split {rest} evenly"
            )
        even = rest // middle if middle else 0
        counts = [even] * stages
        if self.first is not None:
            counts[0] = self.first
        if self.last is not None:
            counts[-1] = self.last
        return counts

    def _validate_against_model(self, model) -> None:
        self.layer_counts(model.num_layers)
        from dataclasses import replace

        # every other rule of the trainer's layout; its even-split rule is replaced by layer_counts
        super()._validate_against_model(replace(model, num_layers=self.pp))

    @property
    def is_trainer_layout(self) -> bool:
        return self.vpp == 1 and self.first is None and self.last is None


def stage_layers(model, layout: ParallelLayout, pp_rank: int) -> list[int]:
    """Global decoder-layer indices one rank of pipeline stage ``pp_rank`` holds, in model order."""
    if not isinstance(layout, PipelineLayout) or layout.is_trainer_layout:
        per_stage = model.num_layers // layout.pp
        return list(range(pp_rank * per_stage, (pp_rank + 1) * per_stage))
    counts = layout.layer_counts(model.num_layers)
    starts = [sum(counts[:j]) for j in range(len(counts))]
    layers: list[int] = []
    for chunk in range(layout.vpp):
        j = chunk * layout.pp + pp_rank
        layers.extend(range(starts[j], starts[j] + counts[j]))
    return layers


def in_flight_factor(layout: ParallelLayout) -> float:
    """Interleaved 1F1B keeps 1 + (pp - 1) / (pp v) times plain 1F1B's activations on the first stage."""
    vpp = layout.vpp if isinstance(layout, PipelineLayout) else 1
    return 1.0 if vpp == 1 else 1 + (layout.pp - 1) / (layout.pp * vpp)


def bubble_slots(layout: ParallelLayout) -> float:
    vpp = layout.vpp if isinstance(layout, PipelineLayout) else 1
    return (layout.pp - 1) / vpp
