"""Prompt datasets from local JSONL or Parquet files.

Design decisions:
- Load, validate, render and tokenise every row once at start-up: prompt sets are small (1e3-1e5
  rows), and a bad row should fail the run before the first rollout, not hours in. Every error names
  the file and the line (JSONL) or row (Parquet), and for a missing field the fields that are present.
  An empty prompt (no token once rendered) is such a bad row: no engine can generate from it.
- Prompts longer than ``max_prompt_tokens`` -- or than the model's context leaves for them
  (``prompt_budget``: ``model.max_position_embeddings - rollout.max_new_tokens``, or
  ``- rollout.agent.max_tokens`` with an agent, given by the trainer) -- are dropped and counted
  (``stats``), not truncated: a truncated math problem is a different problem, and a prompt past the
  context would be trained on positions the model never had.
- Order is a pure function of (seed, epoch): each epoch is a fresh permutation drawn from
  ``random.Random(f"{seed}/{epoch}")``. Position is (epoch, index into that epoch), so
  ``state_dict()``/``load_state_dict()`` resume exactly; a state from a different file or seed is
  refused rather than silently replayed against other data.
- Batches cross epoch boundaries: ``next_batch(B)`` always returns B records.
- The text the config adds to every prompt (``prompt_suffix``, ``system_prompt``) is encoded once before the
  file is read: the jsonl task's suffix is English, which the default symbol tokenizer cannot encode, and
  the refusal names the config key and the fix (``tokenizer.kind=hf tokenizer.path=...``) instead of a
  character of line 1.
- The Hugging Face ``datasets`` library is not used: pyarrow reads Parquet directly and is a
  dependency already.
"""

from __future__ import annotations

import json
import logging
import os
import random
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gspo_megatron.rollout.data.config import DatasetConfig
from gspo_megatron.rollout.data.records import PromptRecord
from gspo_megatron.rollout.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class DatasetStats:
    rows: int = 0  # rows read (valid JSON objects / Parquet rows)
    kept: int = 0
    too_long: int = 0  # dropped: prompt longer than max_prompt_tokens (or the context's prompt budget)
    bad_utf8: int = 0  # skipped non-UTF-8 lines (on_bad_utf8=skip)
    blank_lines: int = 0


def _resolve_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise ValueError(
        f"cannot tell the format of {str(path)!r} from its suffix; set dataset.format to 'jsonl' or 'parquet'"
    )


def _read_jsonl(path: Path, on_bad_utf8: str, stats: DatasetStats) -> Iterator[tuple[str, dict]]:
    with open(path, "rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                if on_bad_utf8 == "skip":
                    stats.bad_utf8 += 1
                    continue
                raise ValueError(
                    f"{where}: line is not valid UTF-8 (byte {error.start}); fix the file or set "
                    f"dataset.on_bad_utf8=skip to drop such lines"
                ) from None
            if not line.strip():
                stats.blank_lines += 1
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: malformed JSON ({error.msg} at column {error.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
            yield where, row


def _read_parquet(path: Path) -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq

    for row_no, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield f"{path}:row {row_no}", row


_NOT_REGULAR = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _check_regular_file(path: Path) -> None:
    """Refuse a dataset path that is missing or not a regular file (symlinks followed), saying which.
    Checked with ``os.stat``, never by opening: a FIFO's open blocks until a writer comes, and
    /dev/zero never ends."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist (dataset.path)") from None
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"dataset.path {str(path)!r} is a directory; name the .jsonl or .parquet file")
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _NOT_REGULAR if test(mode)), "a special file")
        raise ValueError(f"dataset.path {str(path)!r} is {kind}, not a regular file; name the .jsonl or .parquet file")


def _get_field(row: dict, dotted: str, where: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            present = sorted(value) if isinstance(value, dict) else []
            raise KeyError(f"{where}: missing field {dotted!r}; fields present: {present}")
        value = value[part]
    return value


_EMPTY = {"prompt_suffix": "''", "system_prompt": "null"}  # how each added text is switched off on the command line


class PromptDataset:
    """Records from one local file, served as shuffled, resumable batches."""

    def __init__(self, config: DatasetConfig, tokenizer: Tokenizer, prompt_budget: int | None = None):
        """``prompt_budget``: the most prompt tokens the model's context leaves (None: no model limit)."""
        self.config = config
        self.tokenizer = tokenizer
        self.prompt_budget = prompt_budget
        self.max_prompt_tokens = min(config.max_prompt_tokens, prompt_budget or config.max_prompt_tokens)
        if config.path is None:
            raise ValueError("dataset.path is required for a dataset task (a local .jsonl or .parquet file)")
        self.path = Path(config.path)
        _check_regular_file(self.path)
        self.stats = DatasetStats()
        self._check_added_text()
        stop_strings = [tokenizer.decode([i]) for i in tokenizer.stop_token_ids]
        self.records: list[PromptRecord] = self._load(stop_strings)
        self._epoch, self._position = 0, 0
        self._order = self._permutation(0)

    def _check_added_text(self) -> None:
        """Refuse a prompt suffix or system prompt this tokenizer cannot encode, naming the key and the fix."""
        for key in ("prompt_suffix", "system_prompt"):
            text = getattr(self.config, key)
            if not text:
                continue
            try:
                self.tokenizer.encode(text)
            except ValueError as error:
                raise ValueError(
                    f"task.dataset.{key} cannot be encoded: {error}; or set task.dataset.{key}={_EMPTY[key]} "
                    "if your prompts are in this tokenizer's alphabet"
                ) from None

    def _load(self, stop_strings: list[str]) -> list[PromptRecord]:
        fmt = _resolve_format(self.path, self.config.format)
        if fmt == "jsonl":
            rows = _read_jsonl(self.path, self.config.on_bad_utf8, self.stats)
        else:
            rows = _read_parquet(self.path)
        records = []
        for where, row in rows:
            self.stats.rows += 1
            record = self._make_record(row, where, stop_strings)
            if record is not None:
                records.append(record)
        self.stats.kept = len(records)
        if self.stats.rows == 0 and self.stats.bad_utf8:
            raise ValueError(
                f"dataset file {str(self.path)!r}: all {self.stats.bad_utf8} non-blank lines are not valid UTF-8 "
                f"and were skipped (dataset.on_bad_utf8=skip); is it the right file, or another encoding?"
            )
        if self.stats.rows == 0:
            raise ValueError(f"dataset file {str(self.path)!r} is empty: no records (stats: {self.stats})")
        if not records:
            raise ValueError(
                f"dataset {str(self.path)!r}: all {self.stats.rows} prompts are longer than "
                f"{self._prompt_limit_text()} (stats: {self.stats})"
            )
        if self.stats.too_long or self.stats.bad_utf8:
            logger.warning("dataset %s: %s; prompt limit: %s", self.path, self.stats, self._prompt_limit_text())
        return records

    def _prompt_limit_text(self) -> str:
        """Which limit drops long prompts, and the key that moves it."""
        if self.max_prompt_tokens < self.config.max_prompt_tokens:
            return (
                f"the {self.max_prompt_tokens} tokens the model's context leaves for a prompt "
                f"(model.max_position_embeddings - rollout.max_new_tokens, or - rollout.agent.max_tokens with an "
                f"agent; dataset.max_prompt_tokens={self.config.max_prompt_tokens}); use a model with a longer "
                "context or lower rollout.max_new_tokens (rollout.agent.max_tokens)"
            )
        return f"dataset.max_prompt_tokens={self.config.max_prompt_tokens}; raise it"

    def _render(self, prompt: Any, where: str) -> str:
        cfg = self.config
        if isinstance(prompt, str):
            text = prompt + cfg.prompt_suffix
            if not cfg.apply_chat_template:
                return text
            messages = [{"role": "user", "content": text}]
        elif isinstance(prompt, list):
            if not cfg.apply_chat_template:
                raise ValueError(
                    f"{where}: field {cfg.prompt_field!r} holds chat messages; set "
                    f"dataset.apply_chat_template=true to render them"
                )
            messages = list(prompt)
        else:
            raise ValueError(
                f"{where}: field {cfg.prompt_field!r} must be text or a list of chat messages, "
                f"got {type(prompt).__name__}"
            )
        if cfg.system_prompt:
            messages = [{"role": "system", "content": cfg.system_prompt}] + messages
        try:
            return self.tokenizer.render_prompt(messages)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None

    def _make_record(self, row: dict, where: str, stop_strings: list[str]) -> PromptRecord | None:
        cfg = self.config
        prompt = self._render(_get_field(row, cfg.prompt_field, where), where)
        answer = _get_field(row, cfg.answer_field, where)
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(
                f"{where}: field {cfg.answer_field!r} must be text or a number, got {type(answer).__name__}"
            )
        try:
            prompt_ids = self.tokenizer.encode(prompt)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        if not prompt_ids:  # the engine cannot generate from nothing: refused here, not at the first rollout
            raise ValueError(
                f"{where}: the prompt (field {cfg.prompt_field!r}) is empty once rendered and tokenised; every "
                "prompt needs at least one token: fill it in or remove the line"
            )
        if len(prompt_ids) > self.max_prompt_tokens:
            self.stats.too_long += 1
            return None
        metadata = {name: _get_field(row, name, where) for name in cfg.metadata_fields}
        metadata.update(stop_strings=list(stop_strings), source=where)
        return PromptRecord(prompt, str(answer), metadata, tuple(prompt_ids))

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.config.shuffle:
            random.Random(f"{self.config.seed}/{epoch}").shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self.records)

    @property
    def epoch(self) -> int:
        return self._epoch

    def next_batch(self, batch_size: int) -> list[PromptRecord]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        batch: list = []
        while len(batch) < batch_size:
            if self._position == len(self._order):
                self._epoch, self._position = self._epoch + 1, 0
                self._order = self._permutation(self._epoch)
            batch.append(self.records[self._order[self._position]])
            self._position += 1
        return batch

    def state_dict(self) -> dict:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "num_records": len(self.records),
            "seed": self.config.seed,
            "shuffle": self.config.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        expected = {"num_records": len(self.records), "seed": self.config.seed, "shuffle": self.config.shuffle}
        found = {key: state.get(key) for key in expected}
        if found != expected:
            raise ValueError(
                f"dataset state does not belong to this dataset: saved {found}, current {expected}; "
                f"resume with the same file, seed and shuffle setting"
            )
        if not 0 <= state["position"] <= len(self.records) or state["epoch"] < 0:
            raise ValueError(f"dataset state has an invalid position: {state}")
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self._epoch)
