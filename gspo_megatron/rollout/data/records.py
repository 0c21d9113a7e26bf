"""The unit of work every task and dataset hands to the trainer: one prompt and its gold answer.

Design decisions:
- A record is plain, picklable data (it crosses into reward worker processes).
- ``prompt`` is the fully rendered text (chat template already applied); ``prompt_ids`` are its
  tokens, filled in by the task so the trainer feeds exactly the tokens whose length was checked
  against the context and never re-tokenises.
- ``metadata`` carries what verifiers need beyond the answer, with two reserved keys:
  ``stop_strings`` (text of the tokenizer's stop tokens; a response is cut at the first one, and a
  response that contains none did not terminate) and ``answer_pattern`` (a regex the final answer
  must match for ``format_ok``).
- A multi-turn trajectory's reward scores its last turn (the response text) and may read the whole
  trajectory in ``record.trajectory`` (``TrajectoryText``, typed, not a metadata key): the producer hands
  the reward a copy of the record with it set. One signature for every reward, single-turn or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TrajectoryText:
    """What a multi-turn trajectory did, for its reward: each generated turn's text and the text inserted after
    it (a tool's answer and the template around it; '' where nothing was), in order."""

    turns: tuple[str, ...]
    inserted: tuple[str, ...]  # inserted[t] follows turns[t]

    def __post_init__(self) -> None:
        if len(self.turns) != len(self.inserted):
            raise ValueError(f"{len(self.turns)} turns but {len(self.inserted)} inserted texts; give one per turn")


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    answer: str
    metadata: dict = field(default_factory=dict)
    prompt_ids: tuple[int, ...] | None = None
    # set on the copy a multi-turn trajectory's reward gets (the producer); None: a task's record, one response
    trajectory: TrajectoryText | None = None

    def __post_init__(self):
        if not isinstance(self.prompt, str):
            raise TypeError(f"PromptRecord.prompt must be str, got {type(self.prompt).__name__}")
        if not isinstance(self.answer, str):
            raise TypeError(
                f"PromptRecord.answer must be str, got {type(self.answer).__name__} "
                f"(convert numbers with str() when loading)"
            )
