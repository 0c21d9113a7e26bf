import pytest
from local_hf_tokenizer import build_local_hf_tokenizer as _build_local_hf_tokenizer

from gspo_megatron.rollout.data.tokenizer import HFTokenizer, SymbolTokenizer, Tokenizer, build_tokenizer


@pytest.fixture(scope="module")
def symbol():
    return SymbolTokenizer()


@pytest.mark.parametrize(
    "text",
    [
        "max 3817=",
        "<think> step 3 step 8 Wait 8 </think> answer 8<eos>",
        "Alternatively, (1+2)*3/4 - 5 != 0?\n",
        "maximum answers reversed",
        "<pad><eos></think><think>",
        "",
    ],
)
def test_symbol_round_trip(symbol, text):
    assert symbol.decode(symbol.encode(text)) == text


def test_symbol_greedy_longest_match_makes_words_single_tokens(symbol):
    ids = symbol.encode("Wait answer<think>")
    assert ids == [symbol.token_id("Wait"), symbol.token_id(" "), symbol.token_id("answer"), symbol.token_id("<think>")]
    # "max" is a word token; the rest of "maximum" falls back to letters
    assert [symbol.tokens[i] for i in symbol.encode("maximum")] == ["max", "i", "m", "u", "m"]
    # "Alternatively" is 13 characters: one token
    assert len(symbol.encode("Alternatively")) == 1


def test_symbol_special_ids_and_protocol(symbol):
    assert isinstance(symbol, Tokenizer)
    assert (symbol.pad_token_id, symbol.eos_token_id) == (0, 1)
    assert symbol.stop_token_ids == (1,)
    assert symbol.decode([symbol.eos_token_id]) == "<eos>"
    assert symbol.vocab_size == len(symbol.tokens)
    ids = symbol.encode("<think> 8 </think><eos>")
    assert symbol.decode(ids, skip_special_tokens=True) == " 8 "


@pytest.mark.parametrize("text, bad, position", [("max 38Q7=", "Q", 6), ("café", "é", 3), ("Waiting Was", "W", 8)])
def test_symbol_unknown_character_is_named(symbol, text, bad, position):
    with pytest.raises(ValueError) as info:
        symbol.encode(text)
    assert repr(bad) in str(info.value) and f"position {position}" in str(info.value)


def test_symbol_decode_rejects_out_of_range_id(symbol):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        symbol.decode([symbol.vocab_size])


def test_symbol_render_prompt(symbol):
    assert symbol.render_prompt("sum 12=") == "sum 12="
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sum 12="}]
    assert symbol.render_prompt(messages) == "be brief\nsum 12="
    with pytest.raises(ValueError, match="'role' and 'content'"):
        symbol.render_prompt([{"text": "x"}])


def test_hf_tokenizer_from_local_dir(tmp_path):
    reference = _build_local_hf_tokenizer(tmp_path)
    tok = build_tokenizer("hf", str(tmp_path))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    im_end, endoftext = reference.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tok.eos_token_id == im_end and tok.pad_token_id == endoftext
    assert tok.stop_token_ids == (im_end, endoftext)  # eos first, then generation_config's extra one
    assert tok.vocab_size == len(reference)

    rendered = tok.render_prompt("what is 1 + 2 ?")
    assert rendered == "<|im_start|>user\nwhat is 1 + 2 ?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(rendered)
    assert ids.count(tok.eos_token_id) == 1  # the template's <|im_end|> is one special token
    assert tok.decode(ids) == rendered
    assert tok.decode(tok.encode("the answer is \\boxed{3}") + [im_end], skip_special_tokens=True) == (
        "the answer is \\boxed{3}"
    )


def test_hf_tokenizer_stop_ids_without_generation_config(tmp_path):
    reference = _build_local_hf_tokenizer(tmp_path, eos_ids_in_generation_config=False)
    tok = HFTokenizer(tmp_path)
    assert tok.stop_token_ids == (reference.convert_tokens_to_ids("<|im_end|>"),)


def test_hf_tokenizer_missing_dir_and_missing_template(tmp_path):
    with pytest.raises(FileNotFoundError, match="local model directory or a hub id"):
        HFTokenizer(tmp_path / "nope")
    _build_local_hf_tokenizer(tmp_path, chat_template=None)
    with pytest.raises(ValueError, match="apply_chat_template=false"):
        HFTokenizer(tmp_path).render_prompt("hi")


def test_build_tokenizer_errors():
    with pytest.raises(ValueError, match="valid kinds"):
        build_tokenizer("sentencepiece")
    with pytest.raises(ValueError, match="tokenizer.path"):
        build_tokenizer("hf")


def test_symbol_padded_to_the_model_vocabulary():
    from gspo_megatron.rollout.data.tokenizer import SymbolTokenizer

    plain = SymbolTokenizer()
    padded = SymbolTokenizer(padded_vocab_size=80)
    assert padded.vocab_size == 80 and plain.vocab_size == 65
    # ids past the symbols decode to reserved tokens that encode never produces; the vocabulary is frozen
    # (a new symbol would change what ids 65.. decode to, and with it every run that samples them)
    assert padded.decode([7, 65, 70]) == plain.decode([7]) + "<unused_0><unused_5>"
    assert padded.encode("max 37=") == plain.encode("max 37=")
    assert padded.decode([70], skip_special_tokens=True) == ""
    with pytest.raises(ValueError, match="smaller than the 65 symbols"):
        SymbolTokenizer(padded_vocab_size=64)
