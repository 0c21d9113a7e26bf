"""One trigger list for Dynamic Truncated Rollout and step counting, checked once at start-up.

Design decision: the rollout probes at the trigger words ``rollout.truncation.trigger_words`` and the
shapers count steps with ``shaping.step_grpo.triggers`` / ``shaping.metrics.triggers``. Both use one
matching rule (whole words, case-sensitive; ``gspo_megatron/trigger_words.py``), so with
``rollout.truncated=true`` the lists must be equal: otherwise a word could cause a probe and an exit
yet count no step (or the reverse). The check names every key and the fix.
``rollout.truncation.trigger_token_ids`` (triggers given as token ids) need the tokenizer, so they are
checked where it exists (``trainer/setup.py``): each id must decode to one of the trigger words.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gspo_megatron.shaping.config import ShapingConfig


def check_shared_triggers(shaping: ShapingConfig, rollout_triggers: Sequence[str]) -> None:
    """Raise ``ValueError`` when a step-counting trigger list differs from the rollout's."""
    lists = {"shaping.metrics.triggers": (shaping.metrics.triggers, shaping.metrics.case_sensitive)}
    if shaping.name == "step_grpo":
        lists["shaping.step_grpo.triggers"] = (shaping.step_grpo.triggers, shaping.step_grpo.case_sensitive)
    wanted = sorted(rollout_triggers)
    for key, (triggers, case_sensitive) in lists.items():
        if sorted(triggers) != wanted:
            raise ValueError(
                f"rollout.truncated=true probes at rollout.truncation.trigger_words={list(rollout_triggers)} "
                f"but {key}={list(triggers)} counts steps: one trigger list serves both; set them equal"
            )
        if not case_sensitive:
            raise ValueError(
                f"rollout.truncated=true matches triggers case-sensitively (engine stop strings); set "
                f"{key.rsplit('.', 1)[0]}.case_sensitive=true"
            )


def check_trigger_token_ids(
    token_ids: Sequence[int], trigger_words: Sequence[str], decode: Callable[[list[int]], str]
) -> None:
    """Raise ``ValueError`` when a trigger token id does not decode to one of the trigger words: the
    rollout would probe (and exit) at it while step counting, which reads text, counts no step."""
    words = set(trigger_words)
    texts = {token: decode([token]) for token in token_ids}
    stray = {token: text for token, text in texts.items() if text.strip() not in words}
    if stray:
        shown = ", ".join(f"{token} -> {text!r}" for token, text in sorted(stray.items())[:8])
        raise ValueError(
            f"rollout.truncation.trigger_token_ids hold tokens that are not trigger words ({shown}): the "
            f"rollout would probe at them but step counting (rollout.truncation.trigger_words="
            f"{list(trigger_words)}) would not count them; add their text to the trigger words (and the "
            f"shaping trigger lists) or remove the ids"
        )
