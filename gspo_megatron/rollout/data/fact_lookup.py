"""The facts of the ``fact_lookup`` task: made-up entities, each with a code, and the corpus that holds them.

    entity "zorv"  ->  document "zorv.txt": "zorv code 4821"  ->  prompt "code zorv=", answer "4821"

Design decisions:
- The facts are unknowable without the ``lookup`` tool: every name and code is drawn from
  ``random.Random(f"fact_lookup/world/{world_seed}")`` and written nowhere but the corpus, so neither a
  pretrained model nor the warm start has seen them. The warm start (``tools/sft_warmstart.py --demos
  lookup``) demonstrates the format on another world (``WARM_START_WORLD``), so the run's world is new to it too.
- A world is a pure function of its seed and size; the task's corpus (``CORPUS_DIR``, the run's
  ``rollout.agent.corpus_dir``) is that function's output written as files, one small document per entity,
  and a unit test holds the shipped files to it (``python3 tools/write_fact_corpus.py`` rewrites them).
- One document per entity, its name the only word it shares with no other document, so the lookup tool
  (``agents/tools/corpus.py``: most shared words wins) returns the entity's document for any query that
  names it, and "no match" or another entity's document for a query that misspells it.
- Names are four lowercase letters and codes four digits: in the symbol tokenizer's alphabet, and short
  enough that the call, the inserted document and the answer fit the small model's turn budget.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

WORLD_SEED = 0  # the world of the shipped corpus: the one the task asks about
WARM_START_WORLD = 1  # the warm start's demonstrations: other names, other codes
ENTITIES = 128
NAME_LETTERS = 4
CODE_RANGE = (1000, 9999)  # four digits, no leading zero
CORPUS_DIR = "examples/fact_lookup/corpus"  # relative to the repository root (the task's yaml names it)


@dataclass(frozen=True)
class Fact:
    name: str  # the entity: NAME_LETTERS lowercase letters
    code: str  # its attribute: four digits

    @property
    def document(self) -> str:
        """The entity's document in the corpus (what the lookup tool answers)."""
        return f"{self.name} code {self.code}"

    @property
    def file_name(self) -> str:
        return f"{self.name}.txt"


def world(seed: int = WORLD_SEED, size: int = ENTITIES) -> tuple[Fact, ...]:
    """``size`` facts with distinct names, a pure function of (seed, size)."""
    if size < 1:
        raise ValueError(f"a fact world needs at least one entity, got size={size}")
    rng = random.Random(f"fact_lookup/world/{seed}")
    facts: dict[str, Fact] = {}
    while len(facts) < size:  # 26**4 names: a repeat is rare and redrawn
        name = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(NAME_LETTERS))
        code = str(rng.randint(*CODE_RANGE))
        facts.setdefault(name, Fact(name, code))
    return tuple(facts.values())


def corpus_texts(facts: tuple[Fact, ...]) -> dict[str, str]:
    """file name -> document text: the corpus the lookup tool reads. No trailing newline: the tool answers a
    file's text as it is, and the symbol template inserts it as `` <text>\n`` -- what the warm start shows."""
    return {fact.file_name: fact.document for fact in facts}


def write_corpus(directory: str | Path, facts: tuple[Fact, ...]) -> None:
    """Write ``facts``' corpus into ``directory``, replacing the ``.txt`` files it held (and nothing else)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.txt"):
        stale.unlink()
    for name, text in corpus_texts(facts).items():
        (directory / name).write_text(text, encoding="utf-8")
