"""Build a megatron-core ``GPTModel`` of any model family (``core/model_families.py``) from a ``MoEModelConfig``.

Design decisions:
- The TransformerConfig is derived here, in one function, from the HF-terms model config and the
  parallel layout; nothing else constructs one.
- Layer spec: megatron's own decoder-block spec (it handles the dense/MoE layer pattern and the
  pipeline-stage slicing). With TransformerEngine installed and CUDA present we use the TE spec
  unchanged; otherwise the "portable" spec swaps in ``policy/models/layers.py`` norms and SDPA attention.
- Kernel choices follow ``policy/parallel/device.py`` (CUDA or not): the TE spec and where the weights are
  initialised (``use_cpu_initialization`` on CPU). What has no seam in megatron-core is bridged in
  ``policy/cpu_bridges.py``.
- The MoE kernels are config choices with the same defaults on CPU and GPU: the token dispatcher
  (``model.token_dispatcher``, megatron's alltoall or allgather; the alltoall's CUDA stream handling is
  bridged on CPU in ``policy/cpu_bridges.py``) and the expert MLP (``model.expert_mlp``: grouped =
  TEGroupedMLP with the TE spec, ``policy/models/grouped_experts.py`` with the portable one; sequential =
  megatron's SequentialMLP). The portable grouped module keeps SequentialMLP's parameters, so
  checkpoints do not depend on the choice; TEGroupedMLP names expert i's weights
  ``linear_fc{1,2}.weight{i}``, which ``policy/models/conversion.py`` maps to HF like SequentialMLP's.
- ``build_model(..., device="meta")`` builds without allocating (for the real 30B shape).
- Hybrid stacks (Qwen3-Next, Qwen3.5: ``model.linear_attention_layers``) are built through megatron-core's own
  gated DeltaNet (``ssm/gated_delta_net.py``, ``experimental_attention_variant="gated_delta_net"`` with the
  per-layer ``linear_attention_freq`` pattern) and gated full attention (``attention_output_gate``), with the
  portable spec only: megatron's hybrid block spec
  (``experimental_attention_variant_module_specs.py:get_transformer_block_with_experimental_attention_variant_spec``)
  asserts ``transformer_impl == "transformer_engine"``, so the portable block's linear layers take the
  module spec of that file's ``get_gated_delta_net_module_spec`` built with a portable backend. On CPU the
  FLA kernels it calls are the torch rule's (``policy/cpu_bridges.py`` bridge 12).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch
import torch.nn.functional as F

from gspo_megatron.policy.models.config import (
    AttentionKind,
    ExpertMLP,
    LayerSpec,
    ModelConfigError,
    MoEModelConfig,
    TokenDispatcher,
)
from gspo_megatron.policy.models.idle_expert_bias import run_idle_expert_bias_eagerly
from gspo_megatron.policy.parallel.device import compute_device, cuda_kernels
from gspo_megatron.policy.parallel.layout import LayoutError, ParallelLayout


def transformer_engine_available() -> bool:
    """The layer-kernel choice: TransformerEngine's fused layers need CUDA and the package."""
    return cuda_kernels() and importlib.util.find_spec("transformer_engine") is not None


def resolve_spec_name(requested: str) -> str:
    """'auto' -> 'te' where TransformerEngine and CUDA exist, else 'portable'."""
    if requested not in tuple(LayerSpec):
        raise ValueError(f"model.layer_spec={requested!r} is unknown; valid: {', '.join(LayerSpec)}")
    if requested == "auto":
        return "te" if transformer_engine_available() else "portable"
    if requested == "te" and not transformer_engine_available():
        raise RuntimeError(
            "model.layer_spec=te needs TransformerEngine and CUDA; install the `te` extra on a GPU "
            "node or use model.layer_spec=portable"
        )
    return requested


def make_transformer_config(
    model: MoEModelConfig,
    layout: ParallelLayout,
    params_dtype: torch.dtype = torch.float32,
    initialize: bool = True,
    recompute: bool = False,
    routing_replay: bool = True,
    token_dispatcher: str = TokenDispatcher.alltoall,
    te_grouped_experts: bool = False,
):
    """``te_grouped_experts``: TransformerEngine's grouped GEMM experts (the TE spec with
    ``model.expert_mlp=grouped``); the portable spec swaps its experts in ``make_block_spec``."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    model.validate()
    attention_kwargs: dict = {}
    config_class = TransformerConfig
    if model.attention == AttentionKind.mla:
        config_class = MLATransformerConfig
        attention_kwargs = dict(
            multi_latent_attention=True,
            q_lora_rank=model.q_lora_rank or None,
            kv_lora_rank=model.kv_lora_rank,
            qk_head_dim=model.qk_nope_head_dim,
            qk_pos_emb_head_dim=model.qk_rope_head_dim,
            v_head_dim=model.v_head_dim,
            rotary_base=int(model.rope_theta),
            # MLA's own YaRN: cos/sin x m(mscale) / m(mscale_all_dim), softmax scale x m(mscale_all_dim)^2
            rope_type="yarn" if model.rope_yarn else "rope",
            rotary_scaling_factor=model.rope_yarn_factor,
            original_max_position_embeddings=model.rope_yarn_original_max_position_embeddings,
            beta_fast=model.rope_yarn_beta_fast,
            beta_slow=model.rope_yarn_beta_slow,
            mscale=model.rope_yarn_mscale,
            mscale_all_dim=model.rope_yarn_mscale_all_dim,
        )
    attention_kwargs |= _linear_attention_kwargs(model)
    moe_layer_freq = [0 if i in set(model.dense_layers) else 1 for i in range(model.num_layers)]
    moe_kwargs = {}
    if model.is_moe:
        moe_kwargs = dict(
            num_moe_experts=model.num_experts,
            moe_router_topk=model.top_k,
            moe_ffn_hidden_size=model.moe_intermediate_size,
            moe_layer_freq=moe_layer_freq,
            # softmax with norm_topk_prob: softmax over the k chosen logits == softmax-topk-renormalise;
            # sigmoid: the biased scores pick, the unbiased ones of the picked weight, renormalised, x scaling
            moe_router_pre_softmax=not model.norm_topk_prob,
            moe_router_score_function=str(model.router_score),
            moe_router_enable_expert_bias=model.expert_bias,
            moe_router_bias_update_rate=model.expert_bias_update_rate,
            moe_router_num_groups=model.router_groups if model.router_groups > 1 else None,
            moe_router_group_topk=model.router_group_topk if model.router_groups > 1 else None,
            moe_router_topk_scaling_factor=model.routed_scaling_factor if model.routed_scaling_factor != 1.0 else None,
            moe_router_load_balancing_type="aux_loss" if model.router_aux_loss_coef > 0 else "none",
            moe_aux_loss_coeff=model.router_aux_loss_coef,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type=str(TokenDispatcher(token_dispatcher)),
            moe_grouped_gemm=te_grouped_experts,
            moe_permute_fusion=False,
            moe_shared_expert_intermediate_size=model.shared_expert_intermediate_size or None,
            moe_shared_expert_gate=bool(model.shared_expert_intermediate_size)
            and model.architecture.shared_expert_gated,
            # Gives every router a RouterReplay: idle unless an action is set (policy/routing/replay.py).
            # A frozen reference model passes False: its routers have none, so they can never record
            # or replay (megatron's RouterReplay instances live in one process-global list).
            moe_enable_routing_replay=routing_replay,
        )
    config = config_class(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_kv_heads,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.dense_intermediate_size or model.moe_intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_norm,  # per head, or (OLMoE) over all heads: make_block_spec picks the module
        # Qwen3-Next / Qwen3.5 store RMSNorm scales as 1 + w (policy/models/layers.py:RMSNorm reads this)
        layernorm_zero_centered_gamma=model.architecture.zero_centered_norms,
        attention_output_gate=model.attention_output_gate,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        # megatron's uneven stages: layers on the first / last pipeline rank (the rest split evenly)
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        # interleaved 1F1B: each pipeline rank holds vpp chunks (virtual stage c * pp + rank)
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.use_sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=compute_device().type == "cpu",  # initialise where the weights live
        perform_initialization=initialize,
        # Off at build time because megatron refuses it with the allgather dispatcher;
        # policy/models/schedule.py turns it on for a call whose micro-batches differ in shape.
        variable_seq_lengths=False,
        # Gradients are sums of the losses' global-denominator contributions (policy/models/schedule.py).
        calculate_per_token_loss=True,
        # megatron's own default, "full", is deprecated by megatron (it warns at every build); [] means the same
        cuda_graph_scope=[],
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=False,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        **moe_kwargs,
        **attention_kwargs,
    )
    if model.rope_yarn and model.attention == AttentionKind.gqa:
        _set_gqa_yarn(config, model)
    return config


def _linear_attention_kwargs(model: MoEModelConfig) -> dict:
    """megatron's gated DeltaNet settings: the per-layer pattern (1 = linear attention) and its shape."""
    if not model.linear_attention_layers:
        return {}
    linear = set(model.linear_attention_layers)
    return dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[1 if i in linear else 0 for i in range(model.num_layers)],
        linear_conv_kernel_dim=model.linear_conv_kernel_dim,
        linear_key_head_dim=model.linear_key_head_dim,
        linear_value_head_dim=model.linear_value_head_dim,
        linear_num_key_heads=model.linear_num_key_heads,
        linear_num_value_heads=model.linear_num_value_heads,
    )


def _set_gqa_yarn(config, model: MoEModelConfig) -> None:
    """GPTModel's YaRN (``position_embedding_type="yarn"``) and its attention's cos/sin factor read these
    attributes, which TransformerConfig does not declare (megatron-core 0.16 to 0.19): set on the config
    before anything is built (0.19's attention reads them in its constructor)."""
    config.yarn_rotary_scaling_factor = model.rope_yarn_factor
    config.yarn_original_max_position_embeddings = model.rope_yarn_original_max_position_embeddings
    config.yarn_beta_fast = model.rope_yarn_beta_fast
    config.yarn_beta_slow = model.rope_yarn_beta_slow
    config.yarn_mscale = model.rope_yarn_mscale
    config.yarn_mscale_all_dim = model.rope_yarn_mscale_all_dim
    config.yarn_correction_range_round_to_int = True  # transformers' truncate=true


def _mla_without_transformer_engine() -> None:
    """megatron-core's MLA (``multi_latent_attention.py``, 0.16) imports TE's linears inside a ``try`` that
    succeeds without TransformerEngine (megatron's extension module then defines placeholders that are not
    classes), sets ``HAVE_TE = True`` and tests ``isinstance(self.linear_proj, TELinear)``: a TypeError at
    build. Where ``TELinear`` is not a class, TE is absent and ``HAVE_TE`` is set to what it means."""
    from megatron.core.transformer import multi_latent_attention

    if getattr(multi_latent_attention, "HAVE_TE", False) and not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


def _mla_shared_rope_key_gradient() -> None:
    """megatron-core's MLA with column-parallel down projections (its local spec, which the portable spec
    keeps) all-gathers the kv latent and the RoPE key over TP and hands each rank the whole key, which the
    rank's heads use; the all-gather's backward keeps only each rank's own slice of *its* gradient, so the
    key's gradient loses the other ranks' heads (found by the tp2 layout test: every gradient differed from
    one rank's, up to 25%). The latents are fine: their next layer is column-parallel, whose backward
    all-reduces. Fixed at the one place the shared key passes alone, its RoPE: the key (one head,
    ``[s, b, 1, d]``) goes through ``copy_to_tensor_model_parallel_region`` first (identity forward,
    all-reduce backward). Queries (``[s, b, heads / tp, d]``) are told apart by their head count, which
    ``ParallelLayout`` keeps >= 2 for MLA."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
    from megatron.core.transformer import multi_latent_attention

    original = multi_latent_attention.apply_rotary_pos_emb
    if getattr(original, "sums_the_shared_key_gradient", False):
        return

    def apply_rotary_pos_emb(t, *args, **kwargs):
        if t.dim() == 4 and t.shape[-2] == 1 and ps.get_tensor_model_parallel_world_size() > 1:
            t = copy_to_tensor_model_parallel_region(t)
        return original(t, *args, **kwargs)

    apply_rotary_pos_emb.sums_the_shared_key_gradient = True  # type: ignore[attr-defined]
    multi_latent_attention.apply_rotary_pos_emb = apply_rotary_pos_emb


def make_block_spec(
    config,
    spec_name: str,
    expert_mlp: str = ExpertMLP.grouped,
    vp_stage: int | None = None,
    all_heads_qk_norm: bool = False,
):
    """The decoder block spec of one model chunk (``vp_stage``: its virtual stage under vpp > 1).
    ``all_heads_qk_norm``: q/k RMSNorm over all heads' width (OLMoE; ``policy/models/layers.py:AllHeadsRMSNorm``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    use_te = spec_name == "te"
    # the block of full-attention layers first; the gated DeltaNet layers are swapped in below. megatron 0.19's
    # get_gpt_decoder_layer_specs refuses a config with an experimental attention variant (0.16 ignores it),
    # so the variant is hidden from it for the call
    variant, config.experimental_attention_variant = config.experimental_attention_variant, None
    try:
        block = get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
        )
    finally:
        config.experimental_attention_variant = variant
    if use_te and all_heads_qk_norm:
        raise ModelConfigError(
            "q/k norms over all heads (OLMoE) are built with the portable layer spec only (TE's are per head); "
            "set model.layer_spec=portable"
        )
    if use_te:  # grouped: config.moe_grouped_gemm already chose TEGroupedMLP
        return block
    from gspo_megatron.policy.models.grouped_experts import GroupedExperts
    from gspo_megatron.policy.models.layers import (
        AllHeadsKeyRMSNorm,
        AllHeadsRMSNorm,
        QKRMSNorm,
        RMSNorm,
        SDPACoreAttention,
    )

    grouped = ExpertMLP(expert_mlp) == ExpertMLP.grouped
    for layer in block.layer_specs:
        sub = layer.submodules
        sub.input_layernorm = RMSNorm
        sub.pre_mlp_layernorm = RMSNorm
        attn = sub.self_attention.submodules
        attn.core_attention = SDPACoreAttention
        if config.multi_latent_attention:  # RMSNorm on the q and kv latents (their widths, not a head's)
            _mla_without_transformer_engine()
            _mla_shared_rope_key_gradient()
            attn.q_layernorm = RMSNorm
            attn.kv_layernorm = RMSNorm
        elif all_heads_qk_norm:
            attn.q_layernorm = AllHeadsRMSNorm
            attn.k_layernorm = AllHeadsKeyRMSNorm
        elif config.qk_layernorm:  # else megatron's spec has IdentityOp there
            attn.q_layernorm = QKRMSNorm
            attn.k_layernorm = QKRMSNorm
        moe = _submodules_of(sub.mlp)
        experts = getattr(moe, "experts", None)
        if experts is not None and grouped:
            moe.experts = _with_module(experts, GroupedExperts)  # SequentialMLP's parameters, one grouped GEMM
    block.layer_norm = RMSNorm
    if config.experimental_attention_variant == "gated_delta_net":
        _with_gated_delta_net_layers(block, config, vp_stage)
    return block


def _with_gated_delta_net_layers(block, config, vp_stage: int | None) -> None:
    """The block's linear-attention layers (``config.linear_attention_freq``, by global layer) with megatron's
    gated DeltaNet spec, its input norm a layer norm of its own (the portable in_proj is a plain column-parallel
    linear). Each such layer gets its own spec objects: megatron's layer specs share them between layers."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_gated_delta_net_module_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from gspo_megatron.policy.models.layers import GatedOutputRMSNorm, RMSNorm

    class PortableBackend(LocalSpecProvider):
        def column_parallel_layer_norm_linear(self):
            return ColumnParallelLinear

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
            return GatedOutputRMSNorm

    linear_attention = get_gated_delta_net_module_spec(config, backend=PortableBackend())
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    for index, layer in enumerate(block.layer_specs):
        if config.linear_attention_freq[offset + index]:
            submodules = dataclasses.replace(layer.submodules, self_attention=linear_attention, input_layernorm=RMSNorm)
            block.layer_specs[index] = dataclasses.replace(layer, submodules=submodules)


# megatron-core writes a layer's MLP entry in one of two styles: a ``ModuleSpec`` (0.16) or, from 0.17,
# a builder, ``functools.partial(MoELayer, submodules=MoESubmodules(...))`` whose experts entry is
# ``partial(SequentialMLP, submodules=...)``. The two functions below read and rewrite either style.


def _submodules_of(entry):
    """The ``submodules`` of a layer-spec entry in either style (None for a plain class)."""
    if isinstance(entry, functools.partial):
        return entry.keywords.get("submodules")
    return getattr(entry, "submodules", None)


def _with_module(entry, module: type):
    """``entry`` building ``module`` instead, with the same arguments and submodules."""
    if isinstance(entry, functools.partial):
        return functools.partial(module, *entry.args, **entry.keywords)
    return dataclasses.replace(entry, module=module)


def build_model(model: MoEModelConfig, layout: ParallelLayout, **kwargs):
    """This rank's one model chunk (a layout without virtual pipeline stages); see ``build_model_chunks``."""
    chunks = build_model_chunks(model, layout, **kwargs)
    if len(chunks) != 1:
        raise LayoutError(f"vpp = {layout.vpp} gives each rank {len(chunks)} model chunks: use build_model_chunks")
    return chunks[0]


def build_model_chunks(
    model: MoEModelConfig,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    layer_spec: str = "auto",
    device: str | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    recompute: bool = False,
    routing_replay: bool = True,
    initialize: bool = True,
    token_dispatcher: str = TokenDispatcher.alltoall,
    expert_mlp: str = ExpertMLP.grouped,
) -> list:
    """Build this rank's GPTModel chunks (parallel state must be initialised): one per virtual pipeline
    stage, in order (``layout.vpp``; one without virtual stages). Chunk c of pipeline rank r is virtual
    stage c * pp + r; its layers are ``layout.stage_layers`` in chunk order. The chunks share one
    TransformerConfig, as megatron's interleaved schedule expects.

    ``device="meta"`` builds without allocating parameters (and skips initialisation).
    ``routing_replay=False`` builds routers without megatron's RouterReplay (a reference model);
    ``initialize=False`` skips the random initialisation (weights are loaded afterwards).
    ``pre_process`` / ``post_process`` override the embedding / head placement of a one-chunk build.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    on_meta = device == "meta"
    all_heads_qk_norm = model.qk_norm and not model.architecture.qk_norm_per_head
    spec_name = "portable" if model.portable_spec_only and layer_spec == "auto" else resolve_spec_name(layer_spec)
    if spec_name == "te" and model.linear_attention_layers:
        raise ModelConfigError(
            "model.linear_attention_layers (gated DeltaNet) are built with the portable layer spec only (megatron's "
            "hybrid TE block spec is not wired here); set model.layer_spec=portable or auto"
        )
    config = make_transformer_config(
        model,
        layout,
        params_dtype,
        initialize=initialize and not on_meta,
        recompute=recompute,
        routing_replay=routing_replay,
        token_dispatcher=token_dispatcher,
        te_grouped_experts=spec_name == "te" and ExpertMLP(expert_mlp) == ExpertMLP.grouped,
    )
    virtual = layout.vpp > 1
    if virtual and (pre_process is not None or post_process is not None):
        raise LayoutError("pre_process / post_process overrides are for one-chunk builds (vpp = 1)")
    chunks = []
    for chunk in range(layout.vpp):
        vp_stage = chunk if virtual else None
        kwargs = dict(
            config=config,
            transformer_layer_spec=make_block_spec(
                config,
                spec_name,
                expert_mlp,
                vp_stage=vp_stage,
                all_heads_qk_norm=all_heads_qk_norm,
            ),
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            if pre_process is None
            else pre_process,
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
            if post_process is None
            else post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=model.tie_word_embeddings,
            # MLA makes its own rotary embedding (above); this one is GQA's
            position_embedding_type="yarn" if model.rope_yarn and model.attention == AttentionKind.gqa else "rope",
            rotary_percent=model.rotary_fraction,
            rotary_base=int(model.rope_theta),
            vp_stage=vp_stage,
        )
        if on_meta:
            with torch.device("meta"):
                chunks.append(GPTModel(**kwargs))
        else:
            chunks.append(GPTModel(**kwargs).to(compute_device()))
    run_idle_expert_bias_eagerly(chunks)  # no dynamo trace of a no-op at every process's first forward
    return chunks


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
