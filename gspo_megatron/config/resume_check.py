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
  is accepted and reported, since the user did not choose it. A key that was renamed is compared under
  its new name (``core/config_migrations.py``), so a value changed across a rename is still refused.
- The saved config comes from a file someone may have crafted: it is read as plain data
  (``plain_config``) and a message shows at most ``MAX_SHOWN`` characters of a value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gspo_megatron.core.config_migrations import migrate_config
from gspo_megatron.core.config_node import flatten_dotted

FREE_KEYS = (
    "run_dir",
    "logging.",
    "checkpoint.",
    "parallel.",
    "reward.",
    "routing.enabled",  # the diagnostics (routing.replay changes what is trained)
    "routing.every_n_steps",
    "routing.kinds",
    "rollout.sglang.",
    "rollout.embedded.",
    "trainer.stop_after_steps",
    "optimizer.distributed",  # how Adam's state is stored (equal updates); checkpoint.py checks the kind
    "trainer.eval_every",
    "trainer.eval_prompts",
    "trainer.eval_samples",
    "task.eval_dataset",  # what is evaluated, not what is trained
    "trainer.micro_batch_size",
    "trainer.recompute_activations",
    "trainer.reference_offload",  # where the reference waits between its passes (the same log-probs)
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


MAX_CONFIG_BYTES = 1 << 20  # a run's resolved config.yaml is a few KB
MAX_CONFIG_DEPTH = 32
MAX_SHOWN = 200  # characters of a value shown in a message


def plain_config(text: object, source: str) -> dict:
    """A config YAML as plain data, expanding nothing: no anchors or aliases (the trainer never writes
    them; expanding nested ones is the "billion laughs"), no interpolation or resolver (``${...}`` stays
    the string it is: a checkpoint's config must not read this process's environment), size and
    nesting bounded. ``ResumeConfigError`` names ``source`` otherwise."""
    import yaml

    if not isinstance(text, str) or len(text) > MAX_CONFIG_BYTES:
        raise ResumeConfigError(f"{source}: the saved config is not a config of this trainer (too large or not text)")

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent) or getattr(self.peek_event(), "anchor", None) is not None:
                raise ResumeConfigError(
                    f"{source}: the saved config uses YAML anchors or aliases, which this trainer never writes "
                    "(a crafted config can expand without bound); it is not read"
                )
            self.depth += 1
            if self.depth > MAX_CONFIG_DEPTH:
                raise ResumeConfigError(f"{source}: the saved config nests deeper than {MAX_CONFIG_DEPTH} levels")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    try:
        data = yaml.load(text, Loader=Loader)  # a SafeLoader: plain types only
    except yaml.YAMLError as error:
        raise ResumeConfigError(f"{source}: the saved config is not valid YAML ({str(error)[:MAX_SHOWN]})") from None
    if not isinstance(data, dict):
        raise ResumeConfigError(f"{source}: the saved config is a {type(data).__name__}, not a mapping")
    return data


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + f"... ({len(text)} characters)"


def config_differences(saved_yaml: str, new_yaml: str, source: str = "the checkpoint") -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (saved value, new value) for every key whose value differs (or exists on one side),
    both sides read as plain data (``plain_config``)."""
    saved = flatten_dotted(migrate_config(plain_config(saved_yaml, source))[0])  # written by older code: today's keys
    new = flatten_dotted(plain_config(new_yaml, "this run's config"))
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
    for key, (old, new) in config_differences(saved_yaml, new_yaml, checkpoint).items():
        line = f"{key}: {_shown(old)} -> {_shown(new)}"
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
