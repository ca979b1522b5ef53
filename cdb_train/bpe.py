"""The byte-level BPE tokenizer (``tokenizers``), trained on the training split only.

Ids 0/1/2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` as in Ouro's vocabulary; the 256 byte symbols
follow, then the merges. No normaliser, no added prefix space: decoding the ids of a text gives the text back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_ID = 0
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(docs: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"special token {t} should have id {i}"
    return tok


def encode_documents(tok: Tokenizer, docs: Sequence[str]) -> list[int]:
    """One token stream: each document's ids followed by ``<|endoftext|>``."""
    ids: list[int] = []
    for enc in tok.encode_batch(list(docs), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return ids


def write_tokenizer_files(tok: Tokenizer, folder: Path, model_max_length: int) -> None:
    """``tokenizer.json`` and a ``tokenizer_config.json`` with the special tokens and a ChatML template."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "unk_token": None,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
