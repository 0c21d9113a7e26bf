"""Token-in-token-out: what a trajectory inserts between two turns, as token ids appended to the exact ids
the engine produced -- never a re-rendering and re-tokenisation of the conversation.

    ids of turn k+1's input = ids so far (prompt, every turn's generated tokens, what was inserted)
                              + template.tool_answers(...)   (the tool messages and the next turn's header)

Design decisions:
- A chat template that re-renders its own history may not reproduce what the model generated (Qwen3's
  strips earlier turns' ``<think>`` blocks), so a rendered history is no prefix of the tokens the policy
  produced, and the trainer would score tokens the engine never saw. Only the *delta* of the new
  messages is rendered, from a fixed conversation around them: the tokens after the assistant turn's end
  token, in the rendering of [user, assistant, the new messages] with the generation header.
- The extension check: that delta is only right if the template extends its own rendering -- the
  rendering with the new messages starts with the rendering without them, up to the assistant's end
  token. ``HFChatTemplate`` checks it when it is built, on a probe conversation of three turns, and a
  template that fails is refused at start-up naming the model's tokenizer and the fix (a template
  that renders history as it was, or the symbol format).
- The symbol tokenizer has no chat template: a tool's answer is inserted as `` <answer>\\n`` after the
  call, in its alphabet (characters it cannot encode become ``?``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gspo_megatron.core.tool_call_formats import SYMBOL, ToolCallFormat
from gspo_megatron.rollout.agents.tools.base import ToolResult
from gspo_megatron.rollout.data.tokenizer import HFTokenizer, SymbolTokenizer, Tokenizer


class TemplateError(ValueError):
    """A chat template that does not extend its own rendering: token-in-token-out cannot use it."""


class TurnTemplate(Protocol):
    format: ToolCallFormat

    def tool_answers(self, answers: Sequence[tuple[str, ToolResult]]) -> list[int]:
        """The ids inserted after a turn that called tools: each (tool name, result) as the model reads
        it, and the next turn's header."""


class SymbolTemplate:
    """The symbol tokenizer's tasks: ``<name argument>`` then `` answer\\n``, one call per turn."""

    format = SYMBOL

    def __init__(self, tokenizer: SymbolTokenizer):
        self.tokenizer = tokenizer
        self._alphabet = set(SymbolTokenizer.DIGITS + SymbolTokenizer.PUNCTUATION + SymbolTokenizer.LETTERS)

    def tool_answers(self, answers: Sequence[tuple[str, ToolResult]]) -> list[int]:
        ids: list[int] = []
        for _, result in answers:
            text = result.content if result.error is None else f"error {result.error}"
            ids += self.tokenizer.encode(" " + self.encodable(text) + "\n")
        return ids

    def encodable(self, text: str) -> str:
        """``text`` in the tokenizer's alphabet (lowercased; other characters as ``?``)."""
        return "".join(c if c in self._alphabet else "?" for c in text.lower())


class HFChatTemplate:
    """A Hugging Face tokenizer's own chat template, for the deltas only (module docstring)."""

    def __init__(self, tokenizer: HFTokenizer, format: ToolCallFormat, tools: Sequence[dict] = ()):
        self.tokenizer, self.format, self.tools = tokenizer, format, list(tools)
        self.end_ids = set(tokenizer.stop_token_ids)  # an assistant turn ends on one of these
        self.check_extension()

    def render(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
        """A whole conversation's ids (a trajectory's prompt); ``tools``: the template's own by default."""
        text = self.tokenizer.hf_tokenizer.apply_chat_template(
            messages, tools=tools or self.tools or None, tokenize=False, add_generation_prompt=generation_prompt
        )
        return self.tokenizer.encode(str(text))

    def delta(self, new: list[dict]) -> list[int]:
        """The ids of ``new`` messages (tool answers, a user's reply) and the next turn's header, as they
        follow an assistant turn's end token."""
        return self._delta([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], new)

    def _delta(self, history: list[dict], new: list[dict]) -> list[int]:
        before = self.render(history, generation_prompt=False)
        after = self.render(history + new, generation_prompt=True)
        ends = [i for i, token in enumerate(before) if token in self.end_ids]
        if not ends:
            raise TemplateError(self._refusal("renders an assistant message without an end-of-turn token"))
        end = ends[-1] + 1  # where the model's generation stopped: the assistant's end token, included
        if after[:end] != before[:end]:
            raise TemplateError(self._refusal("does not extend its own rendering when messages are added"))
        return after[end:]

    def tool_answers(self, answers: Sequence[tuple[str, ToolResult]]) -> list[int]:
        return self.delta([{"role": "tool", "name": name, "content": _tool_text(result)} for name, result in answers])

    def check_extension(self) -> None:
        """Three turns of a probe conversation: each rendering extends the one before (module docstring)."""
        history: list[dict] = [{"role": "user", "content": "What is 2+3?"}]
        for turn in range(3):
            history.append({"role": "assistant", "content": f"step {turn}"})
            self._delta(history, [{"role": "tool", "name": "calculator", "content": str(turn)}])
            history.append({"role": "tool", "name": "calculator", "content": str(turn)})

    def _refusal(self, what: str) -> str:
        return (
            f"the chat template of the tokenizer in {self.tokenizer.path} {what}, so a trajectory's next "
            "turn cannot be the exact ids the engine produced plus the new messages (token-in-token-out); "
            "use a model whose template renders past turns as they were, or train single-turn "
            "(rollout.agent.name=none)"
        )


def _tool_text(result: ToolResult) -> str:
    return result.content if result.error is None else f"error ({result.error}): {result.content}"


def build_template(tokenizer: Tokenizer, format: ToolCallFormat, tools: Sequence[dict] = ()) -> TurnTemplate:
    """The symbol tokenizer's fixed template, or a Hugging Face tokenizer's own chat template."""
    if isinstance(tokenizer, SymbolTokenizer):
        return SymbolTemplate(tokenizer)
    if isinstance(tokenizer, HFTokenizer):
        return HFChatTemplate(tokenizer, format, tools)
    raise TypeError(f"no turn template for a {type(tokenizer).__name__}")
