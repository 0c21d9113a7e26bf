"""Resume checks what it resumes: the checkpoint's config against the new one, key by key.

Design decisions:
- Both configs are the resolved YAML a run writes (``config.yaml``; the checkpoint keeps its own
  copy), flattened to dotted keys, so a difference is named exactly (``optimizer.lr: 0.001 -> 0.1``).
- Three kinds of key. Free: deployment and bookkeeping that do not change what is trained (where
  files go, logging, checkpoint cadence, the parallel layout, which checkpoints reshard across,
  reward workers, engine deployment, diagnostics, whether the optimizer state is sharded, the MoE
  token dispatcher and expert MLP). Fixed:
  the model's shape (``model.*``), which no checkpoint of another shape can fill. Everything else
  (algorithm, optimizer, task, steps, rollout sampling, ...) refuses unless named in
  ``checkpoint.resume_allow_changes`` (a key, or a section ending in '.'), so a changed run is a
  decision, never an accident.
- A key only one side has comes from another version of the code (a setting added or removed): it
  is accepted and reported, since the user did not choose it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gspo_megatron.config_node import flatten_dotted

FREE_KEYS = (
    "run_dir",
    "logging.",
    "checkpoint.",
    "parallel.",
    "reward.",
    "routing.",
    "rollout.sglang.",
    "rollout.embedded.",
    "trainer.stop_after_steps",
    "optimizer.distributed",  # how Adam's state is stored (equal updates); checkpoint.py checks the kind
    "trainer.eval_every",
    "trainer.eval_prompts",
    "trainer.eval_samples",
    "trainer.micro_batch_size",
    "trainer.recompute_activations",
    "model.hf_checkpoint",
    "model.preset",
    # kernels with the same results: the dispatcher moves tokens differently; the portable grouped
    # experts hold SequentialMLP's parameters
    "model.token_dispatcher",
    "model.expert_mlp",
)
FIXED_KEYS = ("model.",)


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()  # a key one side's schema does not have (the code gained or lost a setting)


class ResumeConfigError(RuntimeError):
    """The new config differs from the checkpoint's in keys that may not change silently."""


def _matches(key: str, patterns: Iterable[str]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


def config_differences(saved_yaml: str, new_yaml: str) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (saved value, new value) for every key whose value differs (or exists on one side)."""
    from omegaconf import OmegaConf

    saved = flatten_dotted(OmegaConf.to_container(OmegaConf.create(saved_yaml), resolve=True))
    new = flatten_dotted(OmegaConf.to_container(OmegaConf.create(new_yaml), resolve=True))
    return {
        k: (saved.get(k, ABSENT), new.get(k, ABSENT))
        for k in sorted(set(saved) | set(new))
        if saved.get(k, ABSENT) != new.get(k, ABSENT)
    }


def validate_allow_list(allowed: Iterable[str]) -> None:
    for key in allowed:
        if _matches(key, FIXED_KEYS) or key.startswith("model"):
            raise ResumeConfigError(
                f"checkpoint.resume_allow_changes names {key!r}: the model's shape cannot change on resume"
            )


def check_resume_config(saved_yaml: str, new_yaml: str, allowed: Iterable[str], checkpoint: str) -> list[str]:
    """Raise ``ResumeConfigError`` listing every refused difference; return the accepted ones as text."""
    allowed = list(allowed)
    validate_allow_list(allowed)
    refused, accepted = [], []
    for key, (old, new) in config_differences(saved_yaml, new_yaml).items():
        line = f"{key}: {old!r} -> {new!r}"
        schema_change = old is ABSENT or new is ABSENT  # another code version, not another choice
        if schema_change or _matches(key, FREE_KEYS) or (not _matches(key, FIXED_KEYS) and _matches(key, allowed)):
            accepted.append(line)
        else:
            refused.append(line)
    if refused:
        fixed = [line for line in refused if _matches(line.split(":")[0], FIXED_KEYS)]
        hint = ("the model's shape cannot change on resume; " if fixed else "") + (
            "to change the others deliberately, list them in checkpoint.resume_allow_changes=[...]"
        )
        raise ResumeConfigError(
            f"refusing to resume {checkpoint}: the config differs from the checkpoint's in "
            f"{len(refused)} key(s):\n  " + "\n  ".join(refused) + f"\n{hint}"
        )
    return accepted
