"""The one trigger-word matching rule: step counting (``rollout/shaping/segmentation.py``) and Dynamic
Truncated Rollout (``rollout/agents/truncated.py``) both match with it, so they count the same words.

Design decisions (torch-free, importable from any layer):
- Trigger words are matched as STANDALONE words: the character before and after a match must not
  be a word character (letter, digit, underscore, Unicode-aware). So "Wait," "Wait." "**Wait**" and
  "(Wait" count, while "Waiting", "Await" and "wait_time" do not. A hyphen is not a word character,
  so "Wait-" counts.
- Matching is case-sensitive by default: the papers name capitalised, sentence-initial markers
  ("Wait", "Alternatively"), and a lower-case "wait" inside a word problem ("wait 5 minutes") is
  not a reasoning step. ``case_sensitive=False`` is available.
- A multi-word trigger ("But wait") matches with any whitespace between its words. All triggers are
  matched in one left-to-right, non-overlapping scan with longer triggers tried first, so "But wait"
  counts once even when "wait" is also a trigger.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence


@functools.lru_cache(maxsize=64)
def _trigger_regex(triggers: tuple[str, ...], case_sensitive: bool) -> re.Pattern:
    words = [t.strip() for t in triggers]
    if not words or any(not w for w in words):
        raise ValueError(f"trigger words must be a non-empty list of non-empty strings, got {list(triggers)!r}")
    # Longest first: at one position the regex takes the first alternative that matches.
    alternatives = sorted(set(words), key=len, reverse=True)
    body = "|".join(r"\s+".join(re.escape(part) for part in w.split()) for w in alternatives)
    return re.compile(rf"(?<!\w)(?:{body})(?!\w)", 0 if case_sensitive else re.IGNORECASE)


def trigger_matches(text: str, triggers: Sequence[str], case_sensitive: bool = True) -> list[re.Match]:
    """Standalone trigger-word occurrences in ``text``, left to right, non-overlapping."""
    return list(_trigger_regex(tuple(triggers), case_sensitive).finditer(text))
