"""Tokenizers: one small protocol, a built-in symbol vocabulary for the synthetic tasks, and a wrapper
around a locally stored Hugging Face tokenizer.

Design decisions:
- The rest of the code sees only the ``Tokenizer`` protocol: encode/decode, the special ids, the stop
  ids the engine must stop on, and ``render_prompt`` (text or chat messages -> the exact prompt text).
- ``SymbolTokenizer`` needs no files, so tiny models train on CPU. Its vocabulary order is frozen
  (ids are part of every checkpoint): append new tokens, never reorder. Encoding is greedy
  longest-match over all token strings, and every single character of the alphabet is itself a
  token, so ``decode(encode(s)) == s`` for any string over the alphabet. Whole-word tokens
  ("Wait", "Alternatively", ...) make reasoning trigger words single tokens, which is what the
  step-counting reward shapers count.
- ``HFTokenizer`` loads from a local directory only (``local_files_only=True``): a hub id in
  ``tokenizer.path`` was resolved to its cached snapshot folder at start-up (``core/hub_checkpoints.py``),
  so nothing here reaches the network. Prompts are rendered with the model's own chat template
  (``add_generation_prompt=True``) and encoded without adding special tokens again (the template
  already wrote BOS where the model wants one). Stop ids are the union of the tokenizer's EOS and
  ``generation_config.json``'s ``eos_token_id`` (Qwen3 stops on both <|im_end|> and <|endoftext|>).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

ChatMessages = Sequence[dict]
PromptInput = str | ChatMessages


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    stop_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def render_prompt(self, prompt: PromptInput) -> str: ...


def _check_messages(messages: ChatMessages) -> None:
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"chat message {i} must be a dict with 'role' and 'content', got {message!r}")


class SymbolTokenizer:
    """A fixed ~80-token vocabulary for the synthetic digit tasks (no files needed)."""

    PAD, EOS, THINK_OPEN, THINK_CLOSE = "<pad>", "<eos>", "<think>", "</think>"
    SPECIAL_TOKENS = (PAD, EOS, THINK_OPEN, THINK_CLOSE)
    DIGITS = tuple("0123456789")
    PUNCTUATION = tuple(" +-*/=()<>,.:?!\n")
    LETTERS = tuple("abcdefghijklmnopqrstuvwxyz")
    # Frozen: a new symbol would take the first reserved id, which a barely-trained policy samples, and change
    # what every existing run decodes (the tool names are spelled letter by letter instead)
    WORDS = ("Wait", "Alternatively", "answer", "step", "max", "sum", "mod", "reverse", "copy")

    def __init__(self, padded_vocab_size: int | None = None):
        """``padded_vocab_size``: the model's vocabulary (>= the 65 symbols). Megatron models round
        the vocabulary up for tensor parallelism, so a policy can sample the extra ids; they decode
        to reserved ``<unused_i>`` tokens (never produced by ``encode``), which no verifier accepts."""
        symbols = self.SPECIAL_TOKENS + self.DIGITS + self.PUNCTUATION + self.LETTERS + self.WORDS
        if padded_vocab_size is not None and padded_vocab_size < len(symbols):
            raise ValueError(
                f"padded_vocab_size={padded_vocab_size} is smaller than the {len(symbols)} symbols; "
                f"the model's vocab_size must be >= {len(symbols)}"
            )
        reserved = tuple(f"<unused_{i}>" for i in range((padded_vocab_size or len(symbols)) - len(symbols)))
        self._tokens: tuple[str, ...] = symbols + reserved
        self._ids = {token: i for i, token in enumerate(self._tokens)}
        if len(self._ids) != len(self._tokens):
            raise AssertionError("SymbolTokenizer vocabulary has duplicate tokens")
        self._longest = max(len(t) for t in symbols)
        self.vocab_size = len(self._tokens)
        self.pad_token_id = self._ids[self.PAD]
        self.eos_token_id = self._ids[self.EOS]
        self.stop_token_ids: tuple[int, ...] = (self.eos_token_id,)
        self._special_ids = frozenset(self._ids[t] for t in self.SPECIAL_TOKENS + reserved)
        self._encodable = {t: i for t, i in self._ids.items() if t not in reserved}

    @property
    def tokens(self) -> tuple[str, ...]:
        return self._tokens

    def token_id(self, token: str) -> int:
        if token not in self._ids:
            raise KeyError(f"{token!r} is not a SymbolTokenizer token; tokens: {list(self._tokens)}")
        return self._ids[token]

    def encode(self, text: str) -> list[int]:
        ids, pos = [], 0
        while pos < len(text):
            for length in range(min(self._longest, len(text) - pos), 0, -1):
                token_id = self._encodable.get(text[pos : pos + length])
                if token_id is not None:
                    ids.append(token_id)
                    pos += length
                    break
            else:
                raise ValueError(
                    f"SymbolTokenizer cannot encode character {text[pos]!r} at position {pos} of "
                    f"{text!r}; its alphabet is digits, lowercase letters, {''.join(self.PUNCTUATION)!r} "
                    f"and the words {list(self.WORDS)}. Free text needs the model's own tokenizer: "
                    "tokenizer.kind=hf tokenizer.path=/path/to/local/model_dir (a folder holding tokenizer.json)"
                )
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        pieces = []
        for token_id in ids:
            token_id = int(token_id)
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
            if skip_special_tokens and token_id in self._special_ids:
                continue
            pieces.append(self._tokens[token_id])
        return "".join(pieces)

    def render_prompt(self, prompt: PromptInput) -> str:
        """No chat template: text passes through; messages are joined in order, one per line."""
        if isinstance(prompt, str):
            return prompt
        _check_messages(prompt)
        return "\n".join(str(m["content"]) for m in prompt)


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (a hub id is resolved to one at start-up)."""

    def __init__(self, local_dir: str | Path):
        path = Path(local_dir)
        if not path.is_dir():
            raise FileNotFoundError(
                f"tokenizer directory {str(path)!r} does not exist; point the tokenizer path at a "
                f"local model directory or a hub id such as Qwen/Qwen3-30B-A3B (core/hub_checkpoints.py)"
            )
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer in {str(path)!r} defines no eos_token; set one in tokenizer_config.json")
        self.eos_token_id: int = int(self._tok.eos_token_id)
        pad = self._tok.pad_token_id
        self.pad_token_id: int = int(pad) if pad is not None else self.eos_token_id
        self.vocab_size: int = len(self._tok)
        self.stop_token_ids: tuple[int, ...] = self._stop_ids(path)
        self.path = path

    def _stop_ids(self, path: Path) -> tuple[int, ...]:
        ids = [self.eos_token_id]
        generation_config = path / "generation_config.json"
        if generation_config.is_file():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
            for token_id in eos if isinstance(eos, list) else [eos]:
                if token_id is not None and int(token_id) not in ids:
                    ids.append(int(token_id))
        return tuple(ids)

    @property
    def hf_tokenizer(self):
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_prompt(self, prompt: PromptInput, tools: Sequence[dict] = ()) -> str:
        """``tools``: OpenAI-shaped tool schemas the template tells the model about (a task that asks for calls)."""
        if not getattr(self._tok, "chat_template", None):
            raise ValueError(
                f"tokenizer in {str(self.path)!r} has no chat template; set "
                f"dataset.apply_chat_template=false to use raw prompt text"
            )
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        _check_messages(messages)
        schemas: list[Any] | None = list(tools) or None  # None: the template's rendering without tools
        rendered = self._tok.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
        return str(rendered)


def build_tokenizer(kind: str, path: str | None = None, model_vocab_size: int | None = None) -> Tokenizer:
    """``kind='symbol'`` -> SymbolTokenizer padded to the model's vocabulary; ``kind='hf'`` -> HFTokenizer(path)."""
    if kind == "symbol":
        return SymbolTokenizer(model_vocab_size)
    if kind == "hf":
        if not path:
            raise ValueError("tokenizer.kind=hf needs tokenizer.path (a local model directory)")
        return HFTokenizer(path)
    raise ValueError(f"unknown tokenizer kind {kind!r}; valid kinds: ['hf', 'symbol']")
