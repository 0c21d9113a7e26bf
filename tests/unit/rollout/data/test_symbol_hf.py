"""The HF form of the symbol tokenizer (used to run the same work in transformers/TRL) gives the
symbol tokenizer's ids and text: greedy longest match, words as single tokens, reserved ids."""

from __future__ import annotations

import random

import pytest

from gspo_megatron.rollout.data.symbol_hf import symbol_tokenizer_as_hf
from gspo_megatron.rollout.data.tokenizer import SymbolTokenizer


@pytest.fixture(scope="module")
def pair():
    symbols = SymbolTokenizer(padded_vocab_size=80)
    return symbols, symbol_tokenizer_as_hf(symbols)


def test_hand_checked_encoding(pair):
    symbols, hf = pair
    text = "Wait max 37=7\n"
    ids = hf(text, add_special_tokens=False)["input_ids"]
    assert ids == symbols.encode(text)
    assert [symbols.tokens[i] for i in ids] == ["Wait", " ", "max", " ", "3", "7", "=", "7", "\n"]
    assert (hf.eos_token_id, hf.pad_token_id, len(hf)) == (symbols.eos_token_id, symbols.pad_token_id, 80)


def test_random_text_and_ids_agree(pair):
    symbols, hf = pair
    alphabet = list("0123456789 +-*/=()<>,.:?!\nabcdefghijklmnopqrstuvwxyz") + list(SymbolTokenizer.WORDS)
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80)))
        assert hf(text, add_special_tokens=False)["input_ids"] == symbols.encode(text), text
        ids = [rng.randrange(80) for _ in range(30)]
        assert hf.decode(ids) == symbols.decode(ids)
        assert hf.decode(ids, skip_special_tokens=True) == symbols.decode(ids, skip_special_tokens=True)
