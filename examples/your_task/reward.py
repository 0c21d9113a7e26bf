"""A reward written as a plain function, as TRL users write them (docs/your_task.md).

``score(response, record)`` gets the generated text and the dataset record (``record.answer`` is the
JSONL line's "answer") and returns a float: 1.0 when the response starts with the answer, else 0.0.
A float above 0 counts as correct in the run's ``reward/accuracy``; a bool works too (True is 1.0).
Named on the command line as ``task.reward=import:examples.your_task.reward:score``.
"""


def score(response: str, record) -> float:
    return 1.0 if response.strip().startswith(record.answer) else 0.0
