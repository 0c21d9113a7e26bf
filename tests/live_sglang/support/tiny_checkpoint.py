"""The tiny HF checkpoint a live SGLang server loads (Qwen3-MoE, or another family's), written by the project's
own export.

The shape is ``conf/model/tiny.yaml`` (the model the 12-step ``rollout=sglang`` job trains), the
weights ``random_hf_state`` (HF checkpoint names, as ``policy/models/conversion.py`` exports them), written by
``models.hf_checkpoint.write_hf_checkpoint`` with the symbol tokenizer saved as a HF tokenizer. No hub.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gspo_megatron.policy.models.config import MoEModelConfig, preset
from gspo_megatron.policy.models.hf_checkpoint import write_hf_checkpoint
from gspo_megatron.rollout.data.symbol_hf import symbol_tokenizer_as_hf
from gspo_megatron.rollout.data.tokenizer import SymbolTokenizer
from gspo_megatron.testing.model_fixtures import random_hf_state


def model_preset(name: str) -> MoEModelConfig:
    """A ``conf/model`` preset as the trainer composes it (``model=<name>``)."""
    from gspo_megatron.config.compose import compose
    from gspo_megatron.config.schema import to_train_config

    return to_train_config(compose([f"model={name}"])).model


def write_tiny_checkpoint(out_dir: Path, seed: int = 0, model: str = "tiny") -> Path:
    """``model``: a ``conf/model`` preset (the tiny Qwen3-MoE, or another family's tiny model)."""
    cfg = preset("tiny") if model == "tiny" else model_preset(model)
    tokenizer_dir = out_dir.with_name(out_dir.name + ".tokenizer")
    symbol_tokenizer_as_hf(SymbolTokenizer(cfg.vocab_size)).save_pretrained(tokenizer_dir)
    state = {name: tensor.to(torch.float32) for name, tensor in random_hf_state(cfg, seed=seed).items()}
    return write_hf_checkpoint([list(state.items())], cfg, out_dir, tokenizer_dir=tokenizer_dir)
