"""Saved configs in today's key layout: the keys a later layout renamed, mapped once (torch-free).

A run directory's ``config.yaml`` and a checkpoint's config keep the keys of the code that wrote them.
Everything that reads a saved config -- the resume check (``config/resume_check.py``), the routing
report and study tools (``core/run_dir.py``) -- reads it through ``migrate_config`` first, so a run
written before a rename resumes, and a setting that changed under its new name is still caught.

Design decisions:
- One table (``RENAMED``: old dotted key -> new dotted key) per layout change, with the issue that
  changed it; a key is moved only when the old path holds a value (a leaf), so a config already in
  today's layout passes unchanged and migrating twice changes nothing.
- The values are moved as they are: no rename here changed a meaning or a default.
- A key that was removed (``REMOVED``: one no run read) is dropped from a saved config, and its entry says
  what replaces it to a run that still sets it.
- Several old keys may become one (the trigger-word lists). Where their saved values differ, the new
  key holds a text naming each (``CONFLICT``): it equals no value a run can set, so a resume refuses
  and names the key instead of picking one list silently.
- A saved config that holds an old key and its new name too (no code wrote it: an edited file) is the same
  case: the new name's value is one of the candidates, never overwritten by the old one (which let the
  wrong resume through and refused the right one, issue 63).
"""

from __future__ import annotations

import copy
from typing import Any

# Issue 47 item 3 (the nested algorithm config): the flat algorithm section's keys, and the two that
# left it (pi_old's source and routing replay decide what runs, not what is optimised).
_LOSS = ("clip_low", "clip_high", "aggregation", "log_ratio_clamp", "clip_ratio_c", "gspo_log_ratio_max")
RENAMED: dict[str, str] = {
    "algorithm.loss": "algorithm.loss.name",
    **{f"algorithm.{key}": f"algorithm.loss.{key}" for key in (*_LOSS, "entropy_coef", "opsm_delta")},
    "algorithm.advantage_estimator": "algorithm.advantage.estimator",
    "algorithm.normalize_std": "algorithm.advantage.normalize_std",
    "algorithm.advantage_eps": "algorithm.advantage.eps",
    "algorithm.kl_coef": "algorithm.kl.coef",
    "algorithm.kl_estimator": "algorithm.kl.estimator",
    "algorithm.kl_reference": "algorithm.kl.reference",
    "algorithm.mismatch_correction": "algorithm.mismatch.correction",
    "algorithm.mismatch_cap": "algorithm.mismatch.cap",
    "algorithm.mismatch_sequence_ratio": "algorithm.mismatch.sequence_ratio",
    "algorithm.mismatch_rejected": "algorithm.mismatch.rejected",
    "algorithm.mismatch_lower": "algorithm.mismatch.lower",
    "algorithm.mismatch_reject": "algorithm.mismatch.reject",
    "algorithm.mismatch_reject_upper": "algorithm.mismatch.reject_upper",
    "algorithm.mismatch_reject_lower": "algorithm.mismatch.reject_lower",
    "algorithm.mismatch_veto": "algorithm.mismatch.veto",
    "algorithm.dynamic_sampling": "algorithm.dynamic_sampling.enabled",
    "algorithm.dynamic_sampling_max_extra_rounds": "algorithm.dynamic_sampling.max_extra_rounds",
    "algorithm.adaptive_clip_target": "algorithm.adaptive_clip.target",
    "algorithm.adaptive_clip_rate": "algorithm.adaptive_clip.rate",
    "algorithm.adaptive_clip_min_scale": "algorithm.adaptive_clip.min_scale",
    "algorithm.adaptive_clip_max_scale": "algorithm.adaptive_clip.max_scale",
    "algorithm.routing_replay": "routing.replay",
    "algorithm.old_log_probs": "trainer.old_log_probs",
    "algorithm.logprob_chunk_size": "trainer.logprob_chunk_size",
    # Issue 47 item 5: one trigger-word list for step counting, its metrics and the DTR probes.
    "shaping.step_grpo.triggers": "shaping.trigger_words",
    "shaping.metrics.triggers": "shaping.trigger_words",
    "rollout.truncation.trigger_words": "shaping.trigger_words",
    "shaping.step_grpo.case_sensitive": "shaping.trigger_case_sensitive",
    "shaping.metrics.case_sensitive": "shaping.trigger_case_sensitive",
}
CONFLICT = "<saved configs differ here: {}>"

# Keys the schema lost, with what replaces them: a run that sets one is refused with this text
# (``config/known_keys.py``); a saved config that holds one has it dropped (``migrate_config``: its value
# changed nothing). Issue 63: the embedded engine is built from the policy's shape
# (``loop/build.py:rollout_settings``), its weights from the first sync, so these two were read by no run.
REMOVED: dict[str, str] = {
    "rollout.embedded.model": (
        "the embedded engine is built from the policy's shape; set the model's keys under model.* "
        "(model=<preset>, e.g. model.num_experts=8)"
    ),
    "rollout.embedded.model_config_path": (
        "the embedded engine is built from the policy's shape; to take the shape of an HF checkpoint set "
        "model.hf_checkpoint=<dir>"
    ),
}


def migrate_config(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``config`` (a saved config as plain nested data) with every renamed key at its new place and every
    removed key gone, and the changes applied (``"old -> new"``, ``"old -> (removed)"``); the given dict
    is not changed."""
    moved = {old: new for old, new in RENAMED.items() if _is_leaf(config, old)}
    removed = [old for old in REMOVED if _holds(config, old)]
    if not moved and not removed:
        return config, []
    out = copy.deepcopy(config)
    for old in removed:  # no run read them: their saved values changed nothing
        _pop(out, old)
    values: dict[str, dict[str, Any]] = {}  # new key -> {old key: value}; every old leaf out first
    for old, new in moved.items():  # ("algorithm.loss" was a leaf that now is the section its name goes into)
        values.setdefault(new, {})[old] = _pop(out, old)
    for new, olds in values.items():
        if _is_leaf(out, new):  # the saved config also holds the new name (module docstring)
            olds[new] = _pop(out, new)
        distinct = {repr(v) for v in olds.values()}
        value = next(iter(olds.values())) if len(distinct) == 1 else CONFLICT.format(olds)
        _set(out, new, value)
    return out, [f"{old} -> {new}" for old, new in moved.items()] + [f"{old} -> (removed)" for old in removed]


_ABSENT = object()


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    """The node at ``dotted`` (a leaf or a section), or ``_ABSENT``."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _holds(tree: dict[str, Any], dotted: str) -> bool:
    return _lookup(tree, dotted) is not _ABSENT


def _is_leaf(tree: dict[str, Any], dotted: str) -> bool:
    node = _lookup(tree, dotted)
    return node is not _ABSENT and not isinstance(node, dict)


def _pop(tree: dict[str, Any], dotted: str) -> Any:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree[part]
    return tree.pop(leaf)


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = tree.get(part)
        if not isinstance(child, dict):
            child = tree[part] = {}
        tree = child
    tree[leaf] = value
