"""Builds a tiny Hugging Face tokenizer directory locally (BPE trained on a few strings, Qwen-style
chat template and special tokens), so tests exercise HFTokenizer without downloading anything."""

import json

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_local_hf_tokenizer(directory, chat_template=CHAT_TEMPLATE, eos_ids_in_generation_config=True):
    """Train a tiny BPE on a few strings and save it as a HF tokenizer directory (no downloads)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    raw = RawTokenizer(models.BPE(unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(["what is 1 + 2 ?", "the answer is \\boxed{3}", "user assistant system"], trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=specials
    )
    if chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(str(directory))
    if eos_ids_in_generation_config:
        ids = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return tok
