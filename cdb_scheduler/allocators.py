"""Resource allocators: paged KV blocks and hidden-state bank rows. Each id is owned by at most one request."""

from __future__ import annotations


class _IdPool:
    """A free list of integer ids with ownership checks (double free and foreign free are bugs)."""

    def __init__(self, ids: range, what: str) -> None:
        self._free = list(reversed(ids))  # pop() hands out the lowest id first
        self._owner: dict[int, int] = {}
        self._what = what
        self.total = len(ids)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def allocate(self, owner: int, n: int = 1) -> list[int] | None:
        """``n`` ids for ``owner``, or None (nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._owner[i] = owner
        return ids

    def free(self, owner: int, ids: list[int]) -> None:
        for i in ids:
            holder = self._owner.pop(i, None)
            assert holder == owner, f"{self._what} {i} freed by {owner} but owned by {holder}"
            self._free.append(i)

    def owners(self) -> dict[int, int]:
        return dict(self._owner)


class BlockAllocator:
    """Paged KV blocks ``0 .. num_blocks-1``, shared by every stage's pool (same ids, per-stage storage), counted
    by reference: a block a prefix cache hit shares is held by each request that reuses it.

    Prefix caching (``cdb_scheduler.prefix_cache``): a full prompt block whose KV is written may be registered
    under its chain hash; when its last holder frees it, it stays cached (least recently freed first to go) and
    counts as free: ``allocate`` takes never-cached blocks first, then evicts cached ones. A block in use is never
    evicted."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self._free = list(reversed(range(num_blocks)))  # pop() hands out the lowest id first
        self._refs: dict[int, int] = {}  # block -> requests holding it
        self._hash_of: dict[int, bytes] = {}  # registered block -> its chain hash
        self._block_of: dict[bytes, int] = {}  # chain hash -> its block
        self._idle: dict[int, None] = {}  # cached blocks no request holds, least recently freed first
        self._writing: dict[bytes, int] = {}  # chain hash -> requests whose prefill is writing that block
        self.total = num_blocks
        self.block_size = block_size
        self.evictions = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        """Blocks a request can get now: never cached, or cached and held by no request (evictable)."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    def allocate(self, owner: int, n: int = 1) -> list[int] | None:
        """``n`` blocks for ``owner`` (never-cached first, then the least recently freed cached ones), or None
        (nothing taken) if fewer are free."""
        if n > len(self._free) + len(self._idle):
            return None
        ids: list[int] = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b = next(iter(self._idle))
                del self._idle[b]
                del self._block_of[self._hash_of.pop(b)]
                self.evictions += 1
            self._refs[b] = 1
            ids.append(b)
        return ids

    def free(self, owner: int, ids: list[int]) -> None:
        for b in ids:
            refs = self._refs.get(b, 0)
            assert refs > 0, f"KV block {b} freed by {owner} but held by no request"
            if refs > 1:
                self._refs[b] = refs - 1
                continue
            del self._refs[b]
            if b in self._hash_of:
                self._idle[b] = None
            else:
                self._free.append(b)

    def cached(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest prefix of ``hashes`` that is cached (not taken)."""
        out: list[int] = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def share(self, ids: list[int]) -> None:
        """Take a reference on each of ``ids`` (cached blocks a request reuses)."""
        for b in ids:
            refs = self._refs.get(b, 0)
            if refs == 0:
                del self._idle[b]
            self._refs[b] = refs + 1

    def writing(self, hashes: list[bytes], delta: int) -> None:
        """Requests' prefills begin (``delta`` 1) or end (-1) writing the blocks of ``hashes``."""
        w = self._writing
        for h in hashes:
            n = w.get(h, 0) + delta
            if n > 0:
                w[h] = n
            else:
                w.pop(h, None)

    def being_written(self, hashes: list[bytes]) -> int:
        """How many of ``hashes``, from the first, a prefill in flight is writing."""
        n = 0
        for h in hashes:
            if h not in self._writing:
                break
            n += 1
        return n

    def register(self, block: int, h: bytes) -> None:
        """``block`` (held, its KV written) holds the prefix whose chain hash is ``h``; a prefix already cached in
        another block keeps that one."""
        if h not in self._block_of and block not in self._hash_of:
            self._block_of[h] = block
            self._hash_of[block] = h

    def clear_cache(self) -> None:
        """Forget every cached prefix (the stages lost their KV): idle cached blocks are free again."""
        self._free.extend(self._idle)
        self._idle.clear()
        self._hash_of.clear()
        self._block_of.clear()
        self._writing.clear()

    def owners(self) -> dict[int, int]:
        """Block -> how many requests hold it."""
        return dict(self._refs)


class RowAllocator(_IdPool):
    """Bank rows of resident requests (``0 .. max_num_seqs-1``); prefill rows are managed separately."""

    def __init__(self, num_rows: int) -> None:
        super().__init__(range(num_rows), "bank row")
