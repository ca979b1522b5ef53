"""The training corpus: the King James Bible as Debian's ``bible-kjv-text`` package ships it.

The package holds ``/usr/lib/bible.data``, the text of the Bible Retrieval System: a header (magic ``EC02``),
a table of block offsets, then 64 KiB blocks of plain text, each compressed on its own with the LZW scheme of
Unix ``compress`` (16-bit codes, block mode; the 3-byte ``compress`` header precedes the first block only). The
decoded text is one verse per line, ``<book><chapter>:<verse> <text>``, after a one-line title.

Preprocessing: the title line and the verse references are dropped; a chapter becomes one document, its verses
joined by newlines. Chapters are numbered in canonical order (Genesis 1 = 0); chapter ``i`` is held out when
``i % holdout_every == holdout_offset`` (defaults 20 and 7: 60 of 1189 chapters, about 5 %). Text files hold
documents separated by a blank line.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKAGE = "bible-kjv-text"
DATA_FILE = "usr/lib/bible.data"
COPYRIGHT_FILE = f"usr/share/doc/{PACKAGE}/copyright"
DEFAULT_CACHE = Path.home() / ".cache" / "cdb-train"
HOLDOUT_EVERY = 20
HOLDOUT_OFFSET = 7
_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")
_COMPRESS_MAGIC = b"\x1f\x9d"


class CorpusError(RuntimeError):
    """The package cannot be fetched, or its data file is not in the expected format."""


@dataclass(frozen=True)
class Chapter:
    book: str
    chapter: int
    verses: tuple[str, ...]

    def text(self) -> str:
        return "\n".join(self.verses)


def lzw_decompress(data: bytes, max_bits: int = 16) -> bytes:
    """Decode one LZW stream of Unix ``compress`` (block mode, no header): codes of 9..``max_bits`` bits,
    least significant bit first, read in groups of ``n_bits`` bytes (a group is abandoned when the code width
    grows or the table is cleared, as the encoder pads it); code 256 clears the table."""
    max_entries = 1 << max_bits
    prefix = [0] * max_entries
    suffix = list(range(256)) + [0] * (max_entries - 256)
    out = bytearray()
    pos = 0  # next unread byte of ``data``
    n_bits, max_code = 9, (1 << 9) - 1
    group, offset, size = 0, 0, 0  # the current group of n_bits bytes as an int; bit offset; usable bits
    clear = False
    free_ent = 257

    def next_code() -> int:
        nonlocal pos, n_bits, max_code, group, offset, size, clear
        if clear or offset >= size or free_ent > max_code:
            if free_ent > max_code:
                n_bits += 1
                max_code = max_entries if n_bits == max_bits else (1 << n_bits) - 1
            if clear:
                n_bits, max_code, clear = 9, (1 << 9) - 1, False
            chunk = data[pos : pos + n_bits]
            pos += len(chunk)
            if not chunk:
                return -1
            group, offset, size = int.from_bytes(chunk, "little"), 0, len(chunk) * 8 - (n_bits - 1)
        code = (group >> offset) & ((1 << n_bits) - 1)
        offset += n_bits
        return code

    old = next_code()
    if old < 0:
        return b""
    if old > 255:
        raise CorpusError(f"LZW stream starts with code {old}")
    fin = old
    out.append(fin)
    while (code := next_code()) >= 0:
        if code == 256:
            clear, free_ent = True, 256
            if (code := next_code()) < 0:
                break
        incoming = code
        stack = []
        if code >= free_ent:  # the KwKwK case: the code being defined right now
            if code > free_ent:
                raise CorpusError(f"corrupt LZW stream: code {code} > next free entry {free_ent}")
            stack.append(fin)
            code = old
        while code >= 256:
            stack.append(suffix[code])
            code = prefix[code]
        fin = suffix[code]
        stack.append(fin)
        out.extend(reversed(stack))
        if free_ent < max_entries:
            prefix[free_ent], suffix[free_ent] = old, fin
            free_ent += 1
        old = incoming
    return bytes(out)


def decode_bible_data(data: bytes) -> str:
    """The plain text of a Bible Retrieval System ``bible.data`` file (see the module docstring)."""
    if not data.startswith(b"EC02"):
        raise CorpusError("bible.data: missing the EC02 magic")
    block_size, n_blocks = struct.unpack(">II", data[0x54:0x5C])
    offsets = struct.unpack(f">{n_blocks + 1}I", data[0x5C : 0x5C + 4 * (n_blocks + 1)])
    if offsets[-1] != len(data) or data[offsets[0] - 3 : offsets[0] - 1] != _COMPRESS_MAGIC:
        raise CorpusError("bible.data: unexpected block table")
    max_bits = data[offsets[0] - 1] & 0x1F
    blocks = [lzw_decompress(data[a:b], max_bits) for a, b in itertools.pairwise(offsets)]
    if any(len(b) != block_size for b in blocks[:-1]):
        raise CorpusError("bible.data: a block did not decode to the block size")
    return b"".join(blocks).decode("ascii")


def parse_chapters(text: str) -> list[Chapter]:
    """Chapters in canonical order from the decoded text (title line skipped, references dropped)."""
    chapters: list[Chapter] = []
    key: tuple[str, int] | None = None
    verses: list[str] = []
    for line in text.split("\n")[1:]:
        if not line.strip():
            continue
        m = _VERSE.match(line)
        if m is None:
            raise CorpusError(f"unexpected line in bible.data: {line[:80]!r}")
        book, chapter, body = m.group(1), int(m.group(2)), " ".join(m.group(4).split())
        if key != (book, chapter):
            if key is not None:
                chapters.append(Chapter(key[0], key[1], tuple(verses)))
            key, verses = (book, chapter), []
        verses.append(body)
    if key is not None:
        chapters.append(Chapter(key[0], key[1], tuple(verses)))
    return chapters


def split_chapters(
    chapters: list[Chapter], every: int = HOLDOUT_EVERY, offset: int = HOLDOUT_OFFSET
) -> tuple[list[Chapter], list[Chapter]]:
    """(train, held-out): chapter ``i`` is held out when ``i % every == offset``."""
    train = [c for i, c in enumerate(chapters) if i % every != offset]
    held = [c for i, c in enumerate(chapters) if i % every == offset]
    return train, held


def write_documents(path: Path, docs: list[str]) -> None:
    path.write_text("\n\n".join(docs) + "\n")


def read_documents(path: Path) -> list[str]:
    return [d for d in path.read_text().rstrip("\n").split("\n\n") if d]


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    try:
        res = subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        raise CorpusError(f"{' '.join(cmd)} failed: {detail.strip()}") from e
    return res.stdout


def fetch_package(cache: Path, package: str = PACKAGE) -> Path:
    """The package's ``.deb`` in ``cache`` (``apt-get download`` when absent)."""
    cache.mkdir(parents=True, exist_ok=True)
    debs = sorted(cache.glob(f"{package}_*.deb"))
    if not debs:
        _run(["apt-get", "download", package], cwd=cache)
        debs = sorted(cache.glob(f"{package}_*.deb"))
    if not debs:
        raise CorpusError(f"apt-get download {package} produced no .deb in {cache}")
    return debs[-1]


def prepare_corpus(cache: Path = DEFAULT_CACHE) -> dict[str, Any]:
    """Fetch, extract, decode and split the corpus into ``cache/corpus/{train,heldout}.txt``; returns (and writes
    as ``source.json``) the provenance: package, version, sha256 of the .deb, copyright file, counts."""
    deb = fetch_package(cache)
    root = cache / "extract"
    _run(["dpkg-deb", "-x", str(deb), str(root)])
    raw = (root / DATA_FILE).read_bytes()
    chapters = parse_chapters(decode_bible_data(raw))
    train, held = split_chapters(chapters)
    out = cache / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    write_documents(out / "train.txt", [c.text() for c in train])
    write_documents(out / "heldout.txt", [c.text() for c in held])
    info: dict[str, Any] = {
        "package": PACKAGE,
        "version": _run(["dpkg-deb", "-f", str(deb), "Version"]).strip(),
        "deb": deb.name,
        "deb_sha256": hashlib.sha256(deb.read_bytes()).hexdigest(),
        "data_file": "/" + DATA_FILE,
        "data_sha256": hashlib.sha256(raw).hexdigest(),
        "copyright": (root / COPYRIGHT_FILE).read_text(),
        "licence": "King James Version text: public domain (copyright expired, per the package's copyright file)",
        "chapters": len(chapters),
        "verses": sum(len(c.verses) for c in chapters),
        "train_chapters": len(train),
        "heldout_chapters": len(held),
        "heldout_rule": f"chapter index i (Genesis 1 = 0) with i % {HOLDOUT_EVERY} == {HOLDOUT_OFFSET}",
        "heldout_first": [f"{c.book} {c.chapter}" for c in held[:5]],
        "train_chars": sum(len(c.text()) for c in train),
        "heldout_chars": sum(len(c.text()) for c in held),
    }
    (out / "source.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
