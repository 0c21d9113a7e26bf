"""The trigger words' rules across sections, checked once at start-up.

Design decision: one list, ``shaping.trigger_words``, serves Dynamic Truncated Rollout's probes and
step counting (Step-GRPO's k, the step metrics), so a word cannot cause a probe and an exit yet count
no step (or the reverse). Two rules remain: DTR matches case-sensitively (engine stop strings), and
``rollout.truncation.trigger_token_ids`` (triggers given as token ids) need the tokenizer, so they are
checked where it exists (``loop/build.py``): each id must decode to one of the trigger words.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gspo_megatron.rollout.shaping.config import ShapingConfig


def check_probing_triggers(shaping: ShapingConfig) -> None:
    """Raise ``ValueError`` when rollout.truncated=true would probe at words counted differently."""
    if not shaping.trigger_case_sensitive:
        raise ValueError(
            "rollout.truncated=true matches the trigger words case-sensitively (engine stop strings), so "
            "step counting must too; set shaping.trigger_case_sensitive=true"
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
            f"rollout would probe at them but step counting (shaping.trigger_words={list(trigger_words)}) "
            f"would not count them; add their text to shaping.trigger_words or remove the ids"
        )
