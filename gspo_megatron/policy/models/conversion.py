"""Hugging Face <-> Megatron weight conversion for every model family, on any parallel layout.

HF names are the *checkpoint* names (what ``save_pretrained`` writes): separate q/k/v projections and
per-expert projections under the family's names (``core/model_families.py``: Qwen3-MoE's
``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``, Mixtral's
``model.layers.{l}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``).

Design decisions:
- One table of ``ParamMapping`` rows, built by walking this rank's megatron parameters, drives both
  directions: which HF tensors make a megatron parameter, how they are fused (QKV interleaved by
  query group; gate/up stacked) and along which dimension and group they are sharded.
- Import shards on load: each HF tensor is sliced to this rank's shard *before* fusion, so a rank
  reads only what it owns from a ``WeightSource`` (``policy/models/weight_sources.py``: a dict, or safetensors
  files read lazily).
- Export streams tensor by tensor: parameters are produced in "units" (embedding, each layer,
  head); each parameter is gathered over TP/ETP and EP inside its pipeline stage when its turn comes
  and its HF tensors are broadcast from that stage over the pipeline group (receivers take shapes from
  the model config; only the unit's name order travels). The consumer buckets the stream, so a rank
  holds at most one bucket plus one parameter's gather beyond its shard, never a unit or the model.
- The same walk exports gradients (``tensor_of=gradient_of``), which is how layout-equivalence
  tests compare gradients under HF names.
- Gated DeltaNet (Qwen3-Next, Qwen3.5; megatron's ``GatedDeltaNet``): megatron's ``in_proj`` holds this rank's
  [q | k | v | z | b | a] rows (each TP-sharded by heads on its own) and ``conv1d`` this rank's [q | k | v]
  channels, while the checkpoints write q, k and v in one tensor (and Qwen3-Next all six grouped by key head).
  For these the HF tensors are first cut into megatron's pieces (``megatron_pieces``), each piece is sharded,
  and the local pieces are concatenated; export cuts the local tensor into its pieces, gathers each and writes
  the HF tensors back from them (``hf_tensors``): exact both ways, no arithmetic.
- Gated full attention (``attention_output_gate``): HF's ``q_proj`` gives each head's query then its gate;
  megatron's ``linear_qkv`` holds per query group [queries | their gates | key | value].
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from gspo_megatron.core.model_families import LINEAR_ATTENTION_INPUT_NAMES, LinearAttentionInputs
from gspo_megatron.core.named_tensors import NamedTensor, bucket_named_tensors
from gspo_megatron.policy.models.config import MoEModelConfig
from gspo_megatron.policy.models.hf_shapes import hf_shapes as hf_shapes  # exported here too: the conversion's names
from gspo_megatron.policy.models.weight_sources import (
    ConversionError,
    DictSource,
    SafetensorsSource,
    WeightSource,
    check_checkpoint_names,
)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# The mapping table
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamMapping:
    megatron_name: str
    hf_names: tuple[str, ...]
    fusion: str  # "copy" | "qkv" | "gated_qkv" | "gate_up" | "gdn_in_proj_grouped" | "gdn_in_proj" | "gdn_conv"
    shard_dim: (
        int | None
    )  # dimension of each HF tensor (each megatron piece: PIECEWISE) that is split; None = replicated
    shard_group: str | None  # "tp" | "etp" | None
    unit: str  # export unit: "embed", "layer.{g}", "head"
    expert_local: int | None = None  # local expert index when the parameter is an expert's


def unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(?P<index>\d+)\.(?P<which>linear_fc1|linear_fc2)\.weight$")
# TEGroupedMLP (TE spec, model.expert_mlp=grouped): expert i's weights are linear_fc{1,2}.weight{i},
# each shaped and sharded like SequentialMLP's (policy/models/grouped_experts.py keeps SequentialMLP's names)
_TE_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(?P<which>linear_fc1|linear_fc2)\.weight(?P<index>\d+)$")


def model_chunks(model) -> list:
    """The unwrapped GPTModel chunks of ``model``: one module (DDP-wrapped or not) or a list of
    virtual-pipeline chunks (``policy/models/builder.py:build_model_chunks``)."""
    return [unwrap(chunk) for chunk in model] if isinstance(model, list | tuple) else [unwrap(model)]


def chunk_prefix(chunk: int, count: int) -> str:
    """Parameter names of chunk ``chunk`` carry ``chunk{c}.`` when a rank holds several chunks (each
    chunk numbers its own layers from 0); one chunk keeps megatron's names."""
    return f"chunk{chunk}." if count > 1 else ""


def converted_tensors(model) -> dict[str, torch.Tensor]:
    """This rank's megatron tensors that have HF counterparts: every parameter, and the routers' expert
    bias (a buffer: set from the load, not trained; HF's ``e_score_correction_bias``); names prefixed
    per chunk under virtual pipeline stages (``chunk_prefix``)."""
    chunks = model_chunks(model)
    tensors: dict[str, torch.Tensor] = {}
    for index, chunk in enumerate(chunks):
        prefix = chunk_prefix(index, len(chunks))
        tensors.update({prefix + name: p for name, p in chunk.named_parameters()})
        tensors.update(
            {prefix + name: b for name, b in chunk.named_buffers() if name.endswith("mlp.router.expert_bias")}
        )
    return tensors


def build_mappings(model, cfg: MoEModelConfig, ep_rank: int = 0, ep_size: int = 1) -> list[ParamMapping]:
    """One row per megatron parameter (and expert bias) of this rank's model chunks."""
    chunks = model_chunks(model)
    rows = []
    experts_per_rank = cfg.num_experts // ep_size if cfg.num_experts else 0
    for index, chunk in enumerate(chunks):
        prefix = chunk_prefix(index, len(chunks))
        for name in converted_tensors(chunk):
            row = _mapping_for(chunk, name, cfg, ep_rank * experts_per_rank)
            rows.append(replace(row, megatron_name=prefix + name))
    return rows


def _mapping_for(model, name: str, cfg: MoEModelConfig, first_expert: int) -> ParamMapping:
    if name == "embedding.word_embeddings.weight":
        return ParamMapping(name, ("model.embed_tokens.weight",), "copy", 0, "tp", "embed")
    if name == "output_layer.weight":
        return ParamMapping(name, ("lm_head.weight",), "copy", 0, "tp", "head")
    if name == "decoder.final_layernorm.weight":
        return ParamMapping(name, ("model.norm.weight",), "copy", None, None, "head")
    match = _LAYER.match(name)
    if not match:
        raise ConversionError(f"no HF mapping for megatron parameter {name!r}")
    local_index, rest = int(match.group(1)), match.group(2)
    layer = unwrap(model).decoder.layers[local_index].layer_number - 1  # global, 0-based
    p = f"model.layers.{layer}."
    unit = f"layer.{layer}"
    simple = {
        "input_layernorm.weight": (p + "input_layernorm.weight", None, None),
        "pre_mlp_layernorm.weight": (p + "post_attention_layernorm.weight", None, None),
        # TE spec: the pre-attention norm (and a dense MLP's pre-norm) is fused into the next linear
        "self_attention.linear_qkv.layer_norm_weight": (p + "input_layernorm.weight", None, None),
        "mlp.linear_fc1.layer_norm_weight": (p + "post_attention_layernorm.weight", None, None),
        "self_attention.q_layernorm.weight": (p + "self_attn.q_norm.weight", None, None),
        "self_attention.k_layernorm.weight": (p + "self_attn.k_norm.weight", None, None),
        "self_attention.linear_proj.weight": (p + "self_attn.o_proj.weight", 1, "tp"),
        "mlp.router.weight": (cfg.architecture.router_name(layer), None, None),
        "mlp.linear_fc2.weight": (p + "mlp.down_proj.weight", 1, "tp"),
    }
    if cfg.architecture.shared_expert is not None:
        shared = cfg.architecture.shared_expert_names(layer)
        simple["mlp.shared_experts.linear_fc2.weight"] = (shared["down"], 1, "tp")
        if "gate_weight" in shared:
            simple["mlp.shared_experts.gate_weight"] = (shared["gate_weight"], None, None)
    if cfg.expert_bias:
        simple["mlp.router.expert_bias"] = (cfg.architecture.expert_bias_name(layer), None, None)
    if cfg.attention == "mla" and rest.startswith("self_attention."):
        simple.update(_mla_rows(model, name, cfg, p + "self_attn."))
    if rest in simple:
        hf, dim, group = simple[rest]
        return ParamMapping(name, (hf,), "copy", dim, group, unit)
    if layer in set(cfg.linear_attention_layers) and rest.startswith("self_attention."):
        return _linear_attention_row(name, rest.removeprefix("self_attention."), cfg, layer, unit)
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        names = tuple(p + f"self_attn.{x}_proj.{rest.rsplit('.', 1)[1]}" for x in "qkv")
        return ParamMapping(name, names, "gated_qkv" if cfg.attention_output_gate else "qkv", 0, "tp", unit)
    if rest == "mlp.linear_fc1.weight":
        return ParamMapping(name, (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "gate_up", 0, "tp", unit)
    if rest == "mlp.shared_experts.linear_fc1.weight" and cfg.architecture.shared_expert is not None:
        shared = cfg.architecture.shared_expert_names(layer)
        return ParamMapping(name, (shared["gate"], shared["up"]), "gate_up", 0, "tp", unit)
    expert = _EXPERT.match(rest) or _TE_GROUPED_EXPERT.match(rest)
    if expert:
        local_expert, which = int(expert["index"]), expert["which"]
        e = first_expert + local_expert
        expert_name = functools.partial(cfg.architecture.expert_name, layer, e)
        if which == "linear_fc1":
            names = (expert_name("gate"), expert_name("up"))
            return ParamMapping(name, names, "gate_up", 0, "etp", unit, local_expert)
        return ParamMapping(name, (expert_name("down"),), "copy", 1, "etp", unit, local_expert)
    raise ConversionError(f"no HF mapping for megatron parameter {name!r}")


def _linear_attention_row(name: str, which: str, cfg: MoEModelConfig, layer: int, unit: str) -> ParamMapping:
    """A gated DeltaNet parameter's row (megatron's ``GatedDeltaNet`` names <-> the family's ``linear_attn``)."""
    family = cfg.architecture
    names = family.linear_attention_names(layer)
    if which == "in_proj.weight" and family.linear_attention_inputs is not None:
        inputs = LINEAR_ATTENTION_INPUT_NAMES[family.linear_attention_inputs]
        grouped = family.linear_attention_inputs == LinearAttentionInputs.qkvz_ba
        fusion = "gdn_in_proj_grouped" if grouped else "gdn_in_proj"
        return ParamMapping(name, tuple(names[n] for n in inputs), fusion, 0, "tp", unit)
    rows = {
        "conv1d.weight": ("conv1d", "gdn_conv", 0, "tp"),
        "A_log": ("A_log", "copy", 0, "tp"),
        "dt_bias": ("dt_bias", "copy", 0, "tp"),
        "out_norm.weight": ("norm", "copy", None, None),
        "out_proj.weight": ("out_proj", "copy", 1, "tp"),
    }
    if which not in rows:
        raise ConversionError(f"no HF mapping for megatron parameter {name!r}")
    hf, fusion, dim, group = rows[which]
    return ParamMapping(name, (names[hf],), fusion, dim, group, unit)


def _mla_rows(model, name: str, cfg: MoEModelConfig, a: str) -> dict[str, tuple[str, int | None, str | None]]:
    """Multi-latent attention's rows (megatron's MLASelfAttention <-> DeepSeek-V3's names): the up
    projections are column-parallel by heads; the down projections are column-parallel in megatron's
    local spec (gathered after) and duplicated in the TE spec, which the parameter's own shape tells."""
    down_rows = {"linear_q_down_proj": cfg.q_lora_rank, "linear_kv_down_proj": cfg.kv_lora_rank + cfg.qk_rope_head_dim}
    which = name.split(".")[-2]
    sharded_down = which in down_rows and unwrap(model).get_parameter(name).shape[0] < down_rows[which]
    down_dim, down_group = (0, "tp") if sharded_down else (None, None)
    return {
        "self_attention.linear_q_proj.weight": (a + "q_proj.weight", 0, "tp"),
        "self_attention.linear_q_down_proj.weight": (a + "q_a_proj.weight", down_dim, down_group),
        "self_attention.q_layernorm.weight": (a + "q_a_layernorm.weight", None, None),
        "self_attention.linear_q_up_proj.layer_norm_weight": (a + "q_a_layernorm.weight", None, None),
        "self_attention.linear_q_up_proj.weight": (a + "q_b_proj.weight", 0, "tp"),
        "self_attention.linear_kv_down_proj.weight": (a + "kv_a_proj_with_mqa.weight", down_dim, down_group),
        "self_attention.kv_layernorm.weight": (a + "kv_a_layernorm.weight", None, None),
        "self_attention.linear_kv_up_proj.layer_norm_weight": (a + "kv_a_layernorm.weight", None, None),
        "self_attention.linear_kv_up_proj.weight": (a + "kv_b_proj.weight", 0, "tp"),
    }


# --------------------------------------------------------------------------------------------
# Fusion: HF pieces (already sharded) <-> one megatron tensor
# --------------------------------------------------------------------------------------------
# fusions whose HF tensors are cut into megatron's pieces before sharding (gated DeltaNet's flat q/k/v)
PIECEWISE = ("gdn_in_proj_grouped", "gdn_in_proj", "gdn_conv")


def _linear_widths(cfg: MoEModelConfig) -> tuple[int, int, int, int]:
    """Gated DeltaNet's (key width, value width, value heads, value heads per key head)."""
    heads = cfg.linear_num_value_heads
    per_key = heads // cfg.linear_num_key_heads
    return cfg.linear_num_key_heads * cfg.linear_key_head_dim, heads * cfg.linear_value_head_dim, heads, per_key


def piece_sizes(fusion: str, cfg: MoEModelConfig) -> list[int]:
    """Rows of megatron's pieces of a PIECEWISE tensor, whole: in_proj [q, k, v, z, b, a]; conv1d [q, k, v]."""
    key_width, value_width, heads, _ = _linear_widths(cfg)
    if fusion == "gdn_conv":
        return [key_width, key_width, value_width]
    return [key_width, key_width, value_width, value_width, heads, heads]


def megatron_pieces(fusion: str, tensors: list[torch.Tensor], cfg: MoEModelConfig) -> list[torch.Tensor]:
    """Whole HF tensors -> the pieces megatron shards one by one (the HF tensors themselves for the others)."""
    if fusion not in PIECEWISE:
        return tensors
    if fusion != "gdn_in_proj_grouped":  # flat [q, k, v] (and z, b, a as they are)
        q, k, v = torch.split(tensors[0], piece_sizes("gdn_conv", cfg), dim=0)
        return [q, k, v, *tensors[1:]]
    # Qwen3-Next: per key head [q (hk), k (hk), v (r x hv), z (r x hv)] and [b (r), a (r)]
    qkvz, ba = tensors
    key_heads, per_key = cfg.linear_num_key_heads, _linear_widths(cfg)[3]
    key_dim, value_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    grouped = qkvz.reshape(key_heads, -1, qkvz.shape[-1])
    parts = torch.split(grouped, [key_dim, key_dim, per_key * value_dim, per_key * value_dim], dim=1)
    b, a = torch.split(ba.reshape(key_heads, 2 * per_key, ba.shape[-1]), per_key, dim=1)
    return [part.reshape(-1, qkvz.shape[-1]) for part in (*parts, b, a)]


def hf_tensors(fusion: str, pieces: list[torch.Tensor], cfg: MoEModelConfig) -> list[torch.Tensor]:
    """Whole megatron pieces -> the HF tensors (``megatron_pieces`` inverted)."""
    if fusion not in PIECEWISE:
        return pieces
    if fusion != "gdn_in_proj_grouped":
        return [torch.cat(pieces[:3], dim=0), *pieces[3:]]
    key_heads, hidden = cfg.linear_num_key_heads, pieces[0].shape[-1]
    q, k, v, z, b, a = (piece.reshape(key_heads, -1, hidden) for piece in pieces)
    return [torch.cat([q, k, v, z], dim=1).reshape(-1, hidden), torch.cat([b, a], dim=1).reshape(-1, hidden)]


def fuse(fusion: str, pieces: list[torch.Tensor], cfg: MoEModelConfig) -> torch.Tensor:
    if fusion == "copy":
        return pieces[0]
    if fusion in PIECEWISE:
        return torch.cat(pieces, dim=0)
    if fusion == "gated_qkv":
        # HF q_proj rows per head: [query (hd) | gate (hd)]; megatron per group: [queries | gates | key | value]
        q, k, v = pieces
        hd, hidden = cfg.head_dim, q.shape[1]
        groups = k.shape[0] // hd
        q = q.reshape(groups, -1, 2, hd, hidden)
        queries, gates = (q[:, :, i].reshape(groups, -1, hidden) for i in (0, 1))
        fused = torch.cat([queries, gates, k.reshape(groups, hd, hidden), v.reshape(groups, hd, hidden)], dim=1)
        return fused.reshape(-1, hidden)
    if fusion == "gate_up":
        return torch.cat(pieces, dim=0)
    if fusion == "qkv":
        # megatron interleaves by query group: [g0: q heads of g0, k0, v0 | g1: ...]; a bias as one column
        bias = pieces[0].dim() == 1
        q, k, v = (piece.unsqueeze(-1) if bias else piece for piece in pieces)
        hd = cfg.head_dim
        groups = k.shape[0] // hd
        hidden = q.shape[1]
        q = q.reshape(groups, -1, hd, hidden)
        k = k.reshape(groups, 1, hd, hidden)
        v = v.reshape(groups, 1, hd, hidden)
        fused = torch.cat([q, k, v], dim=1).reshape(-1, hidden)
        return fused.squeeze(-1) if bias else fused
    raise ValueError(f"unknown fusion {fusion!r}")


def split(fusion: str, tensor: torch.Tensor, cfg: MoEModelConfig) -> list[torch.Tensor]:
    if fusion == "copy":
        return [tensor]
    if fusion in PIECEWISE:  # this rank's pieces: each whole piece's 1/tp share
        whole = piece_sizes(fusion, cfg)
        return list(torch.split(tensor, [size * tensor.shape[0] // sum(whole) for size in whole], dim=0))
    if fusion == "gated_qkv":
        hd, hidden = cfg.head_dim, tensor.shape[1]
        per_group = cfg.num_attention_heads // cfg.num_kv_heads
        grouped = tensor.reshape(-1, 2 * per_group + 2, hd, hidden)
        queries, gates = grouped[:, :per_group], grouped[:, per_group : 2 * per_group]
        q = torch.stack([queries, gates], dim=2).reshape(-1, hidden)  # per head [query | gate]
        return [q, grouped[:, 2 * per_group].reshape(-1, hidden), grouped[:, 2 * per_group + 1].reshape(-1, hidden)]
    if fusion == "gate_up":
        return list(tensor.chunk(2, dim=0))
    if fusion == "qkv":
        bias = tensor.dim() == 1
        tensor = tensor.unsqueeze(-1) if bias else tensor
        hd = cfg.head_dim
        q_per_group = cfg.num_attention_heads // cfg.num_kv_heads
        hidden = tensor.shape[1]
        grouped = tensor.reshape(-1, q_per_group + 2, hd, hidden)
        q = grouped[:, :q_per_group].reshape(-1, hidden)
        k = grouped[:, q_per_group].reshape(-1, hidden)
        v = grouped[:, q_per_group + 1].reshape(-1, hidden)
        return [piece.squeeze(-1) if bias else piece for piece in (q, k, v)]
    raise ValueError(f"unknown fusion {fusion!r}")


# --------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------
def _group_rank_size(mesh, group_name: str | None) -> tuple[int, int]:
    if group_name is None or mesh is None:
        return 0, 1
    group = mesh.tp_group if group_name == "tp" else mesh.etp_group
    return dist.get_rank(group), dist.get_world_size(group)


def load_hf_weights(model, cfg: MoEModelConfig, source: WeightSource | Mapping[str, torch.Tensor], mesh=None) -> int:
    """Copy HF-named full tensors into this rank's shards; returns the number of parameters set.

    Every megatron parameter of this rank must be covered; a missing name or a shape that does not
    match the model config raises ``ConversionError`` naming the tensor, and so does a checkpoint
    directory with tensors the model has no place for (``check_checkpoint_names``; the tensors of
    multi-token-prediction layers are logged as not read).
    """
    if not isinstance(source, WeightSource):
        source = DictSource(source)
    if isinstance(source, SafetensorsSource):
        mtp = check_checkpoint_names(source, cfg)
        if mtp and (mesh is None or mesh.is_driver):
            logger.info(
                "%s: %d tensors of multi-token-prediction layers are not read (MTP is not built here)",
                source.directory,
                len(mtp),
            )
    ep_rank, ep_size = (mesh.ep_rank, mesh.layout.ep) if mesh is not None else (0, 1)
    params = converted_tensors(model)
    expected = hf_shapes(cfg)
    count = 0
    with torch.no_grad():
        for row in build_mappings(model, cfg, ep_rank, ep_size):
            rank, size = _group_rank_size(mesh, row.shard_group)
            wholes = []
            for hf_name in row.hf_names:
                full = source.get(hf_name)
                if tuple(full.shape) != expected[hf_name]:
                    raise ConversionError(
                        f"{hf_name} has shape {tuple(full.shape)}, the model config expects {expected[hf_name]}"
                    )
                wholes.append(full)
            pieces = [
                whole.chunk(size, dim=row.shard_dim)[rank] if row.shard_dim is not None else whole
                for whole in megatron_pieces(row.fusion, wholes, cfg)
            ]
            value = fuse(row.fusion, pieces, cfg)
            target = params[row.megatron_name]
            if value.shape != target.shape:
                raise ConversionError(
                    f"{row.megatron_name}: converted shape {tuple(value.shape)} "
                    f"!= parameter shape {tuple(target.shape)}"
                )
            target.copy_(value.to(target.dtype))
            count += 1
    return count


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------
def _units(cfg: MoEModelConfig) -> list[str]:
    return ["embed"] + [f"layer.{layer}" for layer in range(cfg.num_layers)] + ["head"]


def parameter_data(param: torch.Tensor) -> torch.Tensor:
    return param.data


def gradient_of(param: torch.Tensor) -> torch.Tensor:
    """The accumulated gradient: megatron DDP's ``main_grad`` when wrapped, else ``.grad``."""
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad
    if grad is None:
        return torch.zeros_like(param.data)
    return grad


def export_hf_tensors(
    model,
    cfg: MoEModelConfig,
    mesh=None,
    *,
    tensor_of: Callable[[torch.Tensor], torch.Tensor] = parameter_data,
    dtype: torch.dtype | None = None,
    own_stage_only: bool = False,
) -> Iterator[NamedTensor]:
    """Yield (HF name, full tensor) one at a time on every rank; collective: all ranks must iterate.
    ``own_stage_only``: only the units of this rank's pipeline stage, gathered inside the stage and
    shared with no other stage (collective over the stage's ranks only: a pipeline stage's sender).

    Each megatron parameter is gathered (TP/ETP, then EP) inside its pipeline stage when its turn
    comes, and its HF tensors are broadcast from that stage to the others one by one. Beyond its own
    shard a rank holds only the parameter being gathered and what the consumer keeps: the consumer
    decides the bucket (``bucket_named_tensors``), so a sync's memory is one bucket, not one model.
    Order: units (embedding, layers, head), inside a unit the owning stage's parameter order.
    """
    ep_rank, ep_size = (mesh.ep_rank, mesh.layout.ep) if mesh is not None else (0, 1)
    params = converted_tensors(model)
    # what non-owning pipeline stages allocate to receive: the exported tensors' dtype (e.g. fp32
    # main grads of bf16 parameters), identical on every rank; an fp32 expert bias of a bf16 model is
    # sent in it too
    wire_dtype = tensor_of(next(iter(params.values()))).dtype
    by_unit: dict[str, list[ParamMapping]] = {}
    for row in build_mappings(model, cfg, ep_rank, ep_size):
        by_unit.setdefault(row.unit, []).append(row)
    shapes = hf_shapes(cfg)
    for unit in _units(cfg):
        rows = by_unit.get(unit, [])
        if own_stage_only and not rows:
            continue  # another stage's unit
        plan, source = _unit_plan(rows, shapes, cfg, mesh, ep_size, own_stage_only)
        for index, names in enumerate(plan):
            gathered = _gather_row(rows[index], params, cfg, mesh, ep_size, tensor_of, wire_dtype) if rows else {}
            for name in names:
                tensor = _share_across_stages(gathered.get(name), name, shapes, mesh, source, wire_dtype)
                gathered.pop(name, None)  # the consumer holds it now, or nobody does
                yield name, tensor if dtype is None else tensor.to(dtype)


def export_hf_weights(
    model,
    cfg: MoEModelConfig,
    mesh=None,
    *,
    bucket_bytes: int = 64 << 20,
    tensor_of: Callable[[torch.Tensor], torch.Tensor] = parameter_data,
    dtype: torch.dtype | None = None,
) -> Iterator[list[NamedTensor]]:
    """``export_hf_tensors`` in buckets of at most ``bucket_bytes`` (collective: all ranks iterate)."""
    return bucket_named_tensors(export_hf_tensors(model, cfg, mesh, tensor_of=tensor_of, dtype=dtype), bucket_bytes)


def _row_names(row: ParamMapping, cfg: MoEModelConfig, ep_size: int) -> list[str]:
    """The HF names one megatron parameter exports, in the order ``_gather_row`` produces them."""
    if row.expert_local is None or ep_size == 1:
        return list(row.hf_names)
    per_rank = cfg.num_experts // ep_size
    return [
        _rename_expert(which, ep_r * per_rank + row.expert_local) for which in row.hf_names for ep_r in range(ep_size)
    ]


def _unit_plan(rows, shapes, cfg, mesh, ep_size, own_stage_only=False) -> tuple[list[list[str]], int | None]:
    """Per parameter of the unit, the HF names it exports; and the global rank of the owning stage
    that broadcasts them (None without pipeline parallelism, or when the stage keeps its units). Stages
    that do not own the unit learn the plan from the one that does (one small object collective per unit)."""
    plan = [[name for name in _row_names(row, cfg, ep_size) if name in shapes] for row in rows]
    if mesh is None or mesh.layout.pp == 1 or own_stage_only:
        return plan, None
    plans: list = [None] * mesh.layout.pp
    dist.all_gather_object(plans, plan if rows else None, group=mesh.pp_group)
    owner_stage = next(i for i, p in enumerate(plans) if p is not None)
    return plans[owner_stage], dist.get_global_rank(mesh.pp_group, owner_stage)


def _gather_row(row, params, cfg, mesh, ep_size, tensor_of, wire_dtype) -> dict[str, torch.Tensor]:
    """Full HF tensors of one megatron parameter, on the ranks of the stage that owns it."""
    local = tensor_of(params[row.megatron_name]).detach().to(wire_dtype)
    pieces = split(row.fusion, local, cfg)
    if row.shard_dim is not None and mesh is not None:
        group = mesh.tp_group if row.shard_group == "tp" else mesh.etp_group
        if dist.get_world_size(group) > 1:
            pieces = [_all_gather_cat(piece, row.shard_dim, group) for piece in pieces]
    pieces = hf_tensors(row.fusion, pieces, cfg)
    if row.expert_local is None or ep_size == 1:
        return dict(zip(row.hf_names, pieces, strict=True))
    # expert e lives on EP rank e // experts_per_rank: gather this local slot from every EP rank
    out: dict[str, torch.Tensor] = {}
    names = iter(_row_names(row, cfg, ep_size))
    for piece in pieces:
        for tensor in _all_gather_list(piece, mesh.ep_group):
            out[next(names)] = tensor
    return out


def _rename_expert(name: str, expert: int) -> str:
    return re.sub(r"\.experts\.\d+\.", f".experts.{expert}.", name)


def _gather_stacked(tensor: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along dim 0, written straight into one buffer.

    gloo's all-gather stages the output through a flat temporary of the same size (measured: a 4 MiB
    shard into an 8 MiB result peaks at 20 MiB), which would double the largest tensor a sync moves;
    on gloo each rank's part is broadcast into its slice instead (same bytes, no temporary)."""
    tensor = tensor.contiguous()
    world = dist.get_world_size(group)
    stacked = torch.empty((world * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    if dist.get_backend(group) != "gloo":
        dist.all_gather_into_tensor(stacked, tensor, group=group)
        return stacked
    me = dist.get_rank(group)
    for rank, part in enumerate(stacked.chunk(world)):
        if rank == me:
            part.copy_(tensor)
        dist.broadcast(part, src=dist.get_global_rank(group, rank), group=group)
    return stacked


def _all_gather_list(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``tensor``, as views of one gathered buffer."""
    return list(_gather_stacked(tensor, group).chunk(dist.get_world_size(group)))


def _all_gather_cat(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The shards of ``group`` concatenated along ``dim``: along dim 0 the gathered buffer itself (the
    embedding and the head, the largest tensors a sync moves); along another dim reordered once."""
    stacked = _gather_stacked(tensor, group)
    if dim == 0:
        return stacked
    world = dist.get_world_size(group)
    parts = stacked.view(world, *tensor.shape)
    return parts.movedim(0, dim).reshape(*tensor.shape[:dim], world * tensor.shape[dim], *tensor.shape[dim + 1 :])


def _share_across_stages(tensor, name, shapes, mesh, source, wire_dtype) -> torch.Tensor:
    """``tensor`` (on the owning stage) on every stage: broadcast from ``source`` over the pipeline group."""
    if source is None:
        return tensor
    if tensor is None:
        tensor = torch.empty(shapes[name], dtype=wire_dtype, device=mesh.device)
    tensor = tensor.contiguous()
    dist.broadcast(tensor, src=source, group=mesh.pp_group)
    return tensor


def export_hf_state_dict(model, cfg: MoEModelConfig, mesh=None, **kwargs) -> dict[str, torch.Tensor]:
    """The whole model as one HF state dict (tests and small models; prefer the streaming form)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in export_hf_weights(model, cfg, mesh, **kwargs):
        out.update(bucket)
    return out
