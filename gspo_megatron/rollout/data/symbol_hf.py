"""The built-in ``SymbolTokenizer`` as a Hugging Face fast tokenizer, for running the same work in
HF-based code (transformers' ``generate``, TRL) against this project: same ids, same text.

The symbol tokenizer encodes by greedy longest match over its token strings, left to right. The
``tokenizers`` WordPiece model with an empty continuing-subword prefix does exactly that on a single
"word", so the text is not pre-tokenized (spaces and newlines are ordinary tokens) and the word
length limit is lifted; ``Fuse`` joins decoded tokens without separators. Special and reserved
tokens are added tokens (never produced from plain text by the symbol tokenizer; prompts hold none).
"""

from __future__ import annotations

from gspo_megatron.rollout.data.tokenizer import SymbolTokenizer


def symbol_tokenizer_as_hf(symbols: SymbolTokenizer):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(symbols.tokens)}
    backend = Tokenizer(
        models.WordPiece(
            vocab=vocab, unk_token=symbols.PAD, continuing_subword_prefix="", max_input_chars_per_word=1 << 30
        )
    )
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([t for t in symbols.tokens if t in symbols.SPECIAL_TOKENS or t.startswith("<unused_")])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=symbols.PAD,
        eos_token=symbols.EOS,
        unk_token=symbols.PAD,
        clean_up_tokenization_spaces=False,
    )
