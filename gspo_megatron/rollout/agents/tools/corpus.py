"""The ``lookup`` tool: the document of a small local corpus that best matches a query.

Design decisions:
- The score is simple and deterministic so a rollout can be replayed: the number of distinct lowercase
  word tokens (``\\w+``) of the query that occur in the document; the highest score wins, ties go to the
  smallest document name. A query sharing no word with any document gets the content "no match" -- an
  answer, not an error: the model asked a fair question. The answer is the document's text, cut to its
  first ``max_chars`` characters.
- A task ships its corpus as a directory of UTF-8 text files (or, in tests, a dict name -> text). The
  whole corpus is read once, at construction; a call reads nothing from disk. Construction therefore is
  where the directory is policed: every entry is resolved, and a symlink leading outside the directory
  is a ValueError naming it (a corpus that silently read /etc would be worse than one that fails).
  Symlinked folders inside the directory are checked but not walked (their files are already there).
- Document names are paths relative to the directory, with "/" separators; hidden entries (".git",
  ".DS_Store") are skipped; a file that is not UTF-8 is a ValueError naming it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gspo_megatron.rollout.agents.tools.base import ToolResult, ToolSpec

NO_MATCH = "no match"
# what the model is told (a task that asks for lookups renders it into its prompts: tasks.py, fact_lookup)
LOOKUP_SPEC = ToolSpec(
    name="lookup",
    description=(
        "Look up a reference document: returns the text of the document that shares the most words "
        "with the query, or 'no match'."
    ),
    parameters={
        "type": "object",
        "properties": {"query": {"type": "string", "description": "the words to look for"}},
        "required": ["query"],
        "additionalProperties": False,
    },
)
_WORD = re.compile(r"\w+")


def words(text: str) -> frozenset[str]:
    """The distinct lowercase word tokens of ``text``."""
    return frozenset(_WORD.findall(text.lower()))


@dataclass(frozen=True)
class _Document:
    name: str
    text: str
    words: frozenset[str]


def read_corpus(directory: str | os.PathLike[str]) -> dict[str, str]:
    """name -> text of every file under ``directory``; raises ValueError for a symlink leaving it."""
    root = Path(directory).resolve(strict=True)
    if not root.is_dir():
        raise ValueError(f"corpus: {directory} is not a directory")
    texts: dict[str, str] = {}
    for folder, dirnames, filenames in os.walk(root):  # followlinks=False: a linked folder is listed, not walked
        for name in dirnames + filenames:
            path = Path(folder, name)
            target = path.resolve()
            if not target.is_relative_to(root):
                raise ValueError(f"corpus: {path} leads outside the corpus directory {root} (to {target})")
        dirnames[:] = sorted(name for name in dirnames if not name.startswith("."))
        for name in sorted(filenames):
            path = Path(folder, name)
            if name.startswith(".") or not path.resolve().is_file():  # hidden, or a link to nothing
                continue
            try:
                texts[path.relative_to(root).as_posix()] = path.resolve().read_text(encoding="utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"corpus: {path} is not UTF-8 text ({error.reason})") from None
    return texts


class CorpusLookup:
    """``lookup(query)``: the text of the corpus document sharing the most words with the query."""

    def __init__(
        self, corpus: str | os.PathLike[str] | Mapping[str, str], max_chars: int = 2000, timeout_s: float = 2.0
    ):
        """``corpus``: a directory of UTF-8 text files, or name -> text."""
        if max_chars <= 0:
            raise ValueError(f"max_chars must be > 0, got {max_chars}")
        texts = dict(corpus) if isinstance(corpus, Mapping) else read_corpus(corpus)
        self.documents = [_Document(name, texts[name], words(texts[name])) for name in sorted(texts)]
        self.max_chars = max_chars
        self.timeout_s = timeout_s
        self.spec = LOOKUP_SPEC

    def best(self, query: str) -> _Document | None:
        """The document sharing the most words with ``query`` (ties: the smallest name); None if none shares one."""
        wanted = words(query)
        best, best_score = None, 0
        for document in self.documents:  # sorted by name: a later document must score more to win a tie
            score = len(wanted & document.words)
            if score > best_score:
                best, best_score = document, score
        return best

    def call(self, arguments: dict[str, Any]) -> ToolResult:
        document = self.best(arguments["query"])
        return ToolResult(NO_MATCH if document is None else document.text[: self.max_chars])
