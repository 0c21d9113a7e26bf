"""Config dataclasses of the in-process rollout engine and of dynamic truncated rollout.

Design decisions:
- Plain dataclasses with typed defaults; the lead registers them in Hydra's ConfigStore
  (``conf/rollout/embedded.yaml`` holds the YAML defaults of the embedded engine).
- The model shape is not duplicated here: ``model`` holds ``transformers.Qwen3MoeConfig`` keyword
  arguments (the same numbers the trainer's model config uses) and ``model_config_path`` may point at
  an HF checkpoint's ``config.json``; ``model`` entries override what the file says.
- Truncated-rollout strings (trigger words, probe suffix, thinking close) are text, turned into token
  ids by the caller's tokenizer at run time, so the same config serves any tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class EmbeddedConfig:
    """The transformers-based rollout engine that runs inside the trainer process."""

    model: Dict[str, Any] = field(default_factory=dict)  # Qwen3MoeConfig kwargs (override the file)
    model_config_path: Optional[str] = None  # HF checkpoint dir or config.json; None: `model` only
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"
    max_batch_size: int = 32  # rows (prompt x sample) decoded together; more are split into chunks
    seed: int = 0  # seeds the engine's generator used when SamplingParams.seed is None
    use_cache: bool = True  # KV cache; False re-runs the whole sequence each step (tests/benchmark)
    attn_implementation: str = "sdpa"  # sdpa | eager
    pad_token_id: int = 0  # filler for left padding; masked, so any valid id works

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass
class TruncatedRolloutConfig:
    """Dynamic Truncated Rollout (Step-GRPO, arXiv 2604.16890); training rollouts only."""

    trigger_words: List[str] = field(default_factory=lambda: ["Wait", "Alternatively"])
    trigger_token_ids: List[int] = field(default_factory=list)  # extra triggers as single token ids
    end_think: str = "</think>"  # the model closing its thinking block ends the probing phase
    end_think_token_ids: List[int] = field(default_factory=list)  # same, as token ids
    probe_suffix: str = "\n\n**Final Answer**\n\\boxed{"  # answer-inducing text appended for a probe
    probe_max_tokens: int = 20  # greedy probe answer length
    close_thinking: str = "\n</think>\n\n"  # inserted after a confident probe, before the answer
    confidence_threshold: float = 0.95  # exit when the probe's confidence is strictly above this
    max_probes: int = 10
    eos_token_ids: List[int] = field(default_factory=list)  # end of the whole response

    def __post_init__(self):
        if not self.trigger_words and not self.trigger_token_ids:
            raise ValueError("TruncatedRolloutConfig needs trigger_words or trigger_token_ids")
        if not 0.0 < self.confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold must be in (0, 1), got {self.confidence_threshold}")
        if self.max_probes < 0 or self.probe_max_tokens < 1:
            raise ValueError("max_probes must be >= 0 and probe_max_tokens >= 1")
