"""Automatic prefix caching: a prompt's full KV blocks, reused by later prompts that begin the same way.

A block is keyed by its chain hash: the hash of the previous block's and its own tokens, from a salt of everything
else its KV depends on (the engine's: KV policy, shared slots, depth, dtype, the initial state's seed, the chunking;
``cdb_engine.prepare``). A prompt's prefill runs every token at full depth, so its KV depends on nothing more: not
on exit rules or thresholds, nor on any other request. Blocks are registered once the prefill chain that wrote them
has completed on every stage (``register``).

Exact by construction: a prefill's chunk boundaries are multiples of ``prefill_chunk_size`` from the prompt's start
and define its result (a chunk attends over the KV of the ones before it). A request reuses the longest cached
chain rounded down to a chunk boundary, and always prefills its last chunk (it samples token 0 there): the chunks
it computes are exactly those it would compute without the cache, over the same KV. A request that scores its prompt
(``prompt_logprobs``) computes it all.
"""

from __future__ import annotations

import hashlib
import math
from array import array

from cdb_scheduler.allocators import BlockAllocator
from cdb_scheduler.config import SchedulerConfig
from cdb_scheduler.request import Request


def prefix_hashes(salt: bytes, prompt: list[int], block_size: int) -> list[bytes]:
    """The chain hashes of ``prompt``'s full blocks (BLAKE2b, 128 bits)."""
    out: list[bytes] = []
    h = salt
    for start in range(0, len(prompt) - block_size + 1, block_size):
        h = hashlib.blake2b(h + array("q", prompt[start : start + block_size]).tobytes(), digest_size=16).digest()
        out.append(h)
    return out


def share_prefix(cfg: SchedulerConfig, blocks: BlockAllocator, req: Request) -> int:
    """Give ``req`` (being admitted, holding no block) the cached blocks of its prompt's longest cached prefix that
    ends at a chunk boundary before its last token; returns the tokens it reuses (0: none), or -1: wait, a prefill
    in flight is writing more of that prefix (the choices of one ``n > 1`` body: the first writes, the others reuse
    it once written). Its own full prompt blocks it is to write are marked as being written (``req.writing``)."""
    if not req.prefix_hashes or req.score_prompt:
        return 0
    chunk, size = cfg.prefill_chunk_size, cfg.kv_block_size
    step = math.lcm(chunk, size)  # (a chunk boundary that is a block boundary too)
    usable = (req.prompt_len - 1) // step * step
    hashes = req.prefix_hashes
    found = blocks.cached(hashes[: usable // size])
    reused = len(found) * size // step * step
    ahead = blocks.being_written(hashes[len(found) : usable // size])
    if (len(found) + ahead) * size // step * step > reused:
        return -1
    if reused:
        shared = found[: reused // size]
        blocks.share(shared)
        req.blocks = shared
    req.writing = hashes[len(found) :]
    blocks.writing(req.writing, 1)
    return reused


def register(cfg: SchedulerConfig, blocks: BlockAllocator, req: Request) -> None:
    """Cache ``req``'s full prompt blocks written so far (its prefill chain is complete on every stage)."""
    n = min(req.prefilled, req.prompt_len) // cfg.kv_block_size
    for block, h in zip(req.blocks[:n], req.prefix_hashes[:n]):
        blocks.register(block, h)
    if req.prefilled >= req.prompt_len and req.writing:
        blocks.writing(req.writing, -1)
        req.writing = []


def release_blocks(blocks: BlockAllocator, req: Request) -> None:
    """Give back ``req``'s blocks (a cached one stays cached, evictable once no request holds it) and end its marks
    on the prefix blocks its prefill was to write."""
    if req.blocks:
        blocks.free(req.rid, req.blocks)
        req.blocks = []
    if req.writing:
        blocks.writing(req.writing, -1)
        req.writing = []
