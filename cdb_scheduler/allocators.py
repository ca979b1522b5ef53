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


class BlockAllocator(_IdPool):
    """Paged KV blocks ``0 .. num_blocks-1``, shared by every stage's pool (same ids, per-stage storage)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(range(num_blocks), "KV block")
        self.block_size = block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


class RowAllocator(_IdPool):
    """Bank rows of resident requests (``0 .. max_num_seqs-1``); prefill rows are managed separately."""

    def __init__(self, num_rows: int) -> None:
        super().__init__(range(num_rows), "bank row")
