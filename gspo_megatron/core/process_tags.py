"""The environment variables that tell a trainer's own processes from everything else (torch-free).

``run/reaper.py`` tags the trainer's environment with ``PROCESS_TAG`` (a fresh id per trainer);
every process started from it inherits the tag, including ones a user's code starts and detaches. What
the reaper stops when the trainer ends is the tagged processes still in the trainer's session, plus
the helpers the trainer deliberately starts in a session of their own (SGLang servers), which carry
``HELPER_TAG`` with the same id (``as_own_helper``). A process that left the session (``setsid``) is
someone's deliberate service and is left alone.
"""

from __future__ import annotations

import os

PROCESS_TAG = "GSPO_TRAINER_PROCESS_TAG"
HELPER_TAG = "GSPO_TRAINER_HELPER_TAG"


def as_own_helper(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) marked as a helper of the trainer this process belongs to,
    for a helper started in a session of its own; unchanged outside a trainer."""
    marked = dict(os.environ if env is None else env)
    tag = marked.get(PROCESS_TAG)
    if tag is not None:
        marked[HELPER_TAG] = tag
    return marked
