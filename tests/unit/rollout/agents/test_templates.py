"""Token-in-token-out's deltas: a chat template's rendering of the new messages after the assistant's end
token, refused where the template does not extend its own rendering; the tool-call formats as data."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))  # the local HF tokenizer builder
from local_hf_tokenizer import CHAT_TEMPLATE, build_local_hf_tokenizer

from gspo_megatron.core.tool_call_formats import HERMES_JSON, SYMBOL, ToolCall
from gspo_megatron.rollout.agents.templates import HFChatTemplate, SymbolTemplate, TemplateError
from gspo_megatron.rollout.agents.tools.base import ToolResult
from gspo_megatron.rollout.data.tokenizer import HFTokenizer, SymbolTokenizer

# a template that shows the model only the last two messages: its rendering of a longer conversation
# does not start with its rendering of a shorter one
FORGETFUL = (
    "{% for m in messages[-2:] %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_delta_is_what_the_template_renders_after_the_assistants_end_token(tmp_path):
    build_local_hf_tokenizer(tmp_path)
    tokenizer = HFTokenizer(tmp_path)
    template = HFChatTemplate(tokenizer, HERMES_JSON)
    delta = template.tool_answers([("calculator", ToolResult("3"))])
    assert tokenizer.decode(delta) == "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"
    # token in, token out: the engine's ids of a turn (ending on its end token) plus the delta are the
    # template's own rendering of the whole conversation
    hf = tokenizer.hf_tokenizer
    messages = [{"role": "user", "content": "what is 1 + 2 ?"}]
    prompt = tokenizer.encode(hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    generated = tokenizer.encode("the answer") + [tokenizer.eos_token_id]
    whole = messages + [{"role": "assistant", "content": "the answer"}, {"role": "tool", "content": "3"}]
    rendered = tokenizer.encode(hf.apply_chat_template(whole, tokenize=False, add_generation_prompt=True))
    assert prompt + generated + delta == rendered


def test_a_template_that_does_not_extend_its_own_rendering_is_refused_at_start_up(tmp_path):
    build_local_hf_tokenizer(tmp_path, chat_template=FORGETFUL)
    with pytest.raises(TemplateError, match=rf"{tmp_path}.*does not extend its own rendering"):
        HFChatTemplate(HFTokenizer(tmp_path), HERMES_JSON)
    build_local_hf_tokenizer(tmp_path / "ok", chat_template=CHAT_TEMPLATE)
    HFChatTemplate(HFTokenizer(tmp_path / "ok"), HERMES_JSON)  # the same tokenizer, a template that extends


def test_the_symbol_template_inserts_the_answer_in_its_alphabet():
    tokenizer = SymbolTokenizer(80)
    template = SymbolTemplate(tokenizer)
    ids = template.tool_answers([("calculator", ToolResult("8738")), ("lookup", ToolResult("Köln {x}"))])
    assert tokenizer.decode(ids) == " 8738\n k?ln ?x?\n"
    assert tokenizer.decode(template.tool_answers([("python", ToolResult("slow", "timeout"))])) == " error timeout\n"


def test_tool_calls_parse_from_a_turns_text_and_malformed_ones_are_counted_not_raised():
    call = ToolCall("calculator", {"expression": "17*514"})
    text = "let me check " + HERMES_JSON.render(call) + " done"
    parsed = HERMES_JSON.parse(text)
    assert parsed.calls == [call] and parsed.malformed == [] and parsed.content == "let me check  done"
    assert HERMES_JSON.parse('<tool_call>{"name": 3}</tool_call>').malformed
    assert HERMES_JSON.parse("<tool_call>{not json</tool_call>").malformed
    assert HERMES_JSON.parse('<tool_call>{"name": "x"}').malformed  # opened, never closed
    assert SYMBOL.parse("<calculator 17*514>").calls == [ToolCall("calculator", {"input": "17*514"})]
    assert SYMBOL.parse("<Bad name>").malformed and SYMBOL.parse("8738").calls == []
