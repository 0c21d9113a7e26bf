"""The parallel layout: one validated dataclass for every parallel dimension.

Design decisions:
- Sizes are given, the data-parallel size is derived: dp = world / (tp * pp * cp). A layout is
  validated against the world size and the model shape *before* any process group or model exists,
  and every conflict is reported with the numbers that conflict.
- Expert parallelism follows megatron-core's "MoE parallel folding": the expert side of the mesh
  is (etp, ep, expert-dp, pp) and must divide the same world; ep need not divide dp.
- Call sites ask the initialised ``ParallelMesh`` (policy/parallel/mesh.py) for groups and ranks; they
  never compute rank arithmetic themselves.
- Pipeline stages follow megatron-core's own fields, so what is validated here is what megatron builds:
  ``first_stage_layers`` / ``last_stage_layers`` are the decoder layers of the first / last pipeline
  *rank* (``num_layers_in_first_pipeline_stage`` / ``..._last_...``; Megatron-LM's
  ``--decoder-first-pipeline-num-layers``), the other ranks split the rest evenly. With ``vpp = v``
  virtual chunks each rank's layers split evenly over its chunks and chunk c of rank r is virtual stage
  c * pp + r (megatron's interleaved order, ``transformer_layer.get_transformer_layer_offset``); the
  trainer builds the chunks (``policy/models/builder.py:build_model_chunks``) and runs megatron's interleaved
  1F1B schedule over them.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel layout that cannot work; the message names the conflicting numbers."""


def gated_delta_net_has_context_parallel() -> bool:
    """Whether the installed megatron-core's gated DeltaNet runs under context parallelism: 0.19's
    ``ssm/gated_delta_net`` package all-to-alls each rank's share of the sequence into a share of the heads
    (``tensor_a2a_cp2hp``) and back; 0.16's module has neither. The fact looked for, not the version."""
    from megatron.core.ssm import gated_delta_net

    return hasattr(gated_delta_net, "tensor_a2a_cp2hp")


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    ep: int = 1  # expert parallel
    etp: int | None = None  # expert tensor parallel; None = same as tp
    cp: int = 1  # context parallel
    sequence_parallel: bool | None = None  # None = on exactly when tp > 1
    world_size: int = 1
    first_stage_layers: int | None = None  # decoder layers on pipeline rank 0; None: an even share
    last_stage_layers: int | None = None  # decoder layers on the last pipeline rank; None: an even share
    vpp: int = 1  # virtual pipeline chunks per rank (interleaved 1F1B)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def use_sequence_parallel(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else bool(self.sequence_parallel)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    def validate(self, model=None) -> ParallelLayout:
        """Raise LayoutError on the first conflict; ``model`` is an optional MoEModelConfig."""
        for name in ("tp", "pp", "ep", "cp", "world_size", "vpp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"parallel.{name} must be a positive integer, got {value!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise LayoutError(f"parallel.etp must be a positive integer or null, got {self.etp!r}")
        dense = self.tp * self.pp * self.cp
        if self.world_size % dense:
            raise LayoutError(
                f"tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {dense} does not divide the world size "
                f"{self.world_size}; choose sizes whose product divides the number of ranks"
            )
        expert = self.expert_tp * self.ep * self.pp
        if self.world_size % expert:
            raise LayoutError(
                f"etp*ep*pp = {self.expert_tp}*{self.ep}*{self.pp} = {expert} does not divide the world "
                f"size {self.world_size}; lower ep or etp"
            )
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise LayoutError(f"parallel.{name} must be a positive integer or null, got {value!r}")
            if value is not None and self.pp == 1:
                raise LayoutError(f"parallel.{name} = {value} needs parallel.pp > 1 (it sizes a pipeline stage)")
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(f"vpp = {self.vpp} needs pp > 1 (virtual stages interleave pipeline ranks)")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("sequence_parallel=true needs tp > 1 (it splits the sequence over the TP group)")
        if model is not None:
            self._validate_against_model(model)
        return self

    def _validate_against_model(self, model) -> None:
        self.stage_layer_counts(model.num_layers)
        checks = [
            (model.num_attention_heads, self.tp, "num_attention_heads", "tp"),
            (model.num_kv_heads, self.tp, "num_kv_heads", "tp"),
            (model.vocab_size, self.tp, "vocab_size", "tp"),
        ]
        if model.is_moe:
            checks += [
                (model.num_experts, self.ep, "num_experts", "ep"),
                (model.moe_intermediate_size, self.expert_tp, "moe_intermediate_size", "etp"),
            ]
        if model.dense_intermediate_size:
            checks.append((model.dense_intermediate_size, self.tp, "dense_intermediate_size", "tp"))
        if getattr(model, "linear_attention_layers", None):
            self._validate_linear_attention()
            # megatron splits the linear-attention heads over tp, then (context parallel: heads all-to-all) cp
            heads_split = self.tp * self.cp
            checks.append((model.linear_num_key_heads, heads_split, "linear_num_key_heads", "tp*cp"))
            checks.append((model.linear_num_value_heads, heads_split, "linear_num_value_heads", "tp*cp"))
        if getattr(model, "attention", "gqa") == "mla":  # megatron's column-parallel down projections
            checks.append((model.q_lora_rank, self.tp, "q_lora_rank", "tp"))
            checks.append(
                (model.kv_lora_rank + model.qk_rope_head_dim, self.tp, "kv_lora_rank + qk_rope_head_dim", "tp")
            )
        for value, size, what, dim in checks:
            if value % size:
                raise LayoutError(
                    f"model.{what} = {value} is not divisible by parallel.{dim} = {size}; "
                    f"choose a {dim} that divides {value}"
                )
        if getattr(model, "attention", "gqa") == "mla" and self.tp > 1 and model.num_attention_heads // self.tp < 2:
            # policy/models/builder.py:_mla_shared_rope_key_gradient tells the shared RoPE key from queries by heads
            raise LayoutError(
                f"multi-latent attention with parallel.tp = {self.tp} needs >= 2 heads per rank: "
                f"model.num_attention_heads = {model.num_attention_heads} gives "
                f"{model.num_attention_heads // self.tp}; choose a smaller tp"
            )
        if model.is_moe and self.tp > 1 and not self.use_sequence_parallel:
            raise LayoutError(
                f"tp = {self.tp} with an MoE model needs sequence parallelism (megatron-core's MoE "
                "layer requires it with tensor parallelism); set parallel.sequence_parallel=true"
            )

    def _validate_linear_attention(self) -> None:
        if self.cp > 1 and not gated_delta_net_has_context_parallel():
            from importlib.metadata import version

            raise LayoutError(
                f"parallel.cp = {self.cp}: gated DeltaNet layers (model.linear_attention_layers) have no context "
                f"parallelism in megatron-core {version('megatron-core')} (0.16: transformer_config.py:983 asserts "
                "context_parallel_size == 1; ssm/gated_delta_net.py:223 'TODO: support CP'); set parallel.cp=1, "
                "or install megatron-core 0.19 (its gated DeltaNet turns the sequence split into a heads split)"
            )

    @property
    def uneven_pipeline(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def stage_layer_counts(self, num_layers: int) -> list[int]:
        """Decoder layers on each pipeline rank, in rank order; LayoutError naming the keys if they do
        not split: the ranks without a fixed count share the rest evenly, and every rank's count is a
        multiple of ``vpp`` (its chunks are equal)."""
        ends = {0: self.first_stage_layers, self.pp - 1: self.last_stage_layers} if self.pp > 1 else {}
        fixed = {rank: n for rank, n in ends.items() if n is not None}
        middle = self.pp - len(fixed)
        rest = num_layers - sum(fixed.values())
        if not self.uneven_pipeline and num_layers % self.pp:
            raise LayoutError(
                f"model.num_layers = {num_layers} is not divisible by parallel.pp = {self.pp}; choose a pp "
                "that divides it, or size the end stages with parallel.first_stage_layers / "
                "parallel.last_stage_layers"
            )
        if rest < 0 or (middle and (rest <= 0 or rest % middle)) or (not middle and rest):
            raise LayoutError(
                f"model.num_layers = {num_layers} over parallel.pp = {self.pp} stages with "
                f"first_stage_layers={self.first_stage_layers} last_stage_layers={self.last_stage_layers}: "
                f"the other {middle} stages cannot share the remaining {rest} layers evenly"
            )
        counts = [rest // middle if middle else 0] * self.pp
        for rank, n in fixed.items():
            counts[rank] = n
        uneven_chunks = [(rank, n) for rank, n in enumerate(counts) if n % self.vpp]
        if uneven_chunks:
            rank, n = uneven_chunks[0]
            raise LayoutError(
                f"pipeline rank {rank} holds {n} layers, not a multiple of vpp = {self.vpp} (each rank's "
                "virtual chunks are equal); choose stage sizes divisible by vpp"
            )
        return counts

    def stage_layers(self, num_layers: int, pp_rank: int) -> list[int]:
        """Global decoder-layer indices pipeline rank ``pp_rank`` holds, in model order: chunk c of rank
        r is virtual stage c * pp + r, and virtual stages hold consecutive layers."""
        chunk_sizes = [n // self.vpp for n in self.stage_layer_counts(num_layers)]
        layers: list[int] = []
        start = 0
        for _chunk in range(self.vpp):
            for rank, size in enumerate(chunk_sizes):
                if rank == pp_rank:
                    layers.extend(range(start, start + size))
                start += size
        return layers


def sequence_multiple(layout: ParallelLayout) -> int:
    """What the fed length must be a multiple of: tp under sequence parallelism, 2 * cp under
    context parallelism (load-balanced chunks)."""
    multiple = layout.tp if layout.use_sequence_parallel else 1
    return multiple * (2 * layout.cp if layout.cp > 1 else 1)
