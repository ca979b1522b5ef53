"""Tokenizers: the ``Tokenizer`` protocol, a built-in byte-level tokenizer and a ``tokenizer.json`` wrapper."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 (as in Ouro's vocabulary)
BYTE_OFFSET = len(SPECIAL_TOKENS)


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """Byte-level tokenizer: ids 0/1/2 = ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``; byte b -> id b + 3.

    Special-token strings in the text encode to their ids. Ids >= 259 (possible with a larger model vocabulary)
    decode to "". Stop ids: 0 and 2; EOS: 0.
    """

    _special = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")

    def __init__(self, vocab_size: int = 512, stop_token_ids: tuple[int, ...] = (0, 2)) -> None:
        if vocab_size < BYTE_OFFSET + 256:
            raise ValueError(f"the byte tokenizer needs a vocabulary of >= {BYTE_OFFSET + 256}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.eos_token_id: int | None = 0

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._special.split(text):
            if part in SPECIAL_TOKENS:
                ids.append(SPECIAL_TOKENS.index(part))
            else:
                ids.extend(b + BYTE_OFFSET for b in part.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
                out.append(i - BYTE_OFFSET)
            elif 0 <= i < BYTE_OFFSET and not skip_special_tokens:
                out.extend(SPECIAL_TOKENS[i].encode())
        return out.decode("utf-8", errors="replace")


class HFTokenizer:
    """Wrapper over ``tokenizers.Tokenizer.from_file(folder / "tokenizer.json")``."""

    def __init__(self, path: str | Path, stop_token_ids: tuple[int, ...] = (), vocab_size: int | None = None):
        from tokenizers import Tokenizer as _HFTok

        self._tok = _HFTok.from_file(str(path))
        self.vocab_size = vocab_size or self._tok.get_vocab_size(with_added_tokens=True)
        self.stop_token_ids = stop_token_ids
        self.eos_token_id: int | None = stop_token_ids[0] if stop_token_ids else None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))
