"""The parallel layout: one validated dataclass for every parallel dimension.

Design decisions:
- Sizes are given, the data-parallel size is derived: dp = world / (tp * pp * cp). A layout is
  validated against the world size and the model shape *before* any process group or model exists,
  and every conflict is reported with the numbers that conflict.
- Expert parallelism follows megatron-core's "MoE parallel folding": the expert side of the mesh
  is (etp, ep, expert-dp, pp) and must divide the same world; ep need not divide dp.
- Call sites ask the initialised ``ParallelMesh`` (parallel/mesh.py) for groups and ranks; they
  never compute rank arithmetic themselves.
"""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A parallel layout that cannot work; the message names the conflicting numbers."""


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    ep: int = 1  # expert parallel
    etp: int | None = None  # expert tensor parallel; None = same as tp
    cp: int = 1  # context parallel
    sequence_parallel: bool | None = None  # None = on exactly when tp > 1
    world_size: int = 1

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
        for name in ("tp", "pp", "ep", "cp", "world_size"):
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
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("sequence_parallel=true needs tp > 1 (it splits the sequence over the TP group)")
        if model is not None:
            self._validate_against_model(model)
        return self

    def _validate_against_model(self, model) -> None:
        checks = [
            (model.num_layers, self.pp, "num_layers", "pp"),
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
            # models/builder.py:_mla_shared_rope_key_gradient tells the shared RoPE key from queries by heads
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
