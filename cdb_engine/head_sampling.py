"""How a stage worker samples a head's rows: logits processing with the penalty histories it keeps on the device
(``History``), the batched sampler, and the logprob columns."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from cdb_model.batched_sampling import Processing, logprob_columns, sample_rows
from cdb_scheduler.plan import HistorySeed


class History:
    """Penalized requests' histories per bank row, on the device: each token's count in the output so far, and
    whether it is in the prompt. Seeded by the scheduler (``HistorySeed``) the first time this stage samples a
    request; every token the stage samples for such a row is counted here, on the device, in the same op."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.counts = torch.zeros((rows, vocab), dtype=torch.int32, device=device)
        self.prompt = torch.zeros((rows, vocab), dtype=torch.bool, device=device)

    def seed(self, rows: Sequence[int], seeds: Sequence[HistorySeed]) -> None:
        """``rows[i]``: the bank row of ``seeds[i]``."""
        dev = self.counts.device
        index = torch.tensor(list(rows), dtype=torch.long, device=dev)
        self.counts.index_fill_(0, index, 0)
        self.prompt.index_fill_(0, index, False)
        out_rows = [r for r, s in zip(rows, seeds) for _ in s.output_ids]
        if out_rows:
            out_ids = [t for s in seeds for t in s.output_ids]
            pairs = torch.tensor([out_rows, out_ids], dtype=torch.long, device=dev)
            self.counts.index_put_((pairs[0], pairs[1]), torch.ones_like(pairs[0], dtype=torch.int32), accumulate=True)
        prompt_rows = [r for r, s in zip(rows, seeds) for _ in s.prompt_ids]
        if prompt_rows:
            pairs = torch.tensor([prompt_rows, [t for s in seeds for t in s.prompt_ids]], dtype=torch.long, device=dev)
            self.prompt[pairs[0], pairs[1]] = True

    def gather(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Counts ``[N, V]`` and seen-anywhere ``[N, V]`` of bank ``rows``."""
        counts = self.counts.index_select(0, rows)
        return counts, self.prompt.index_select(0, rows) | (counts > 0)

    def count(self, rows: Tensor, tokens: Tensor) -> None:
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)


def sample_with_history(
    logits: Tensor,
    history: History | None,
    rows: Tensor,
    table: Tensor | None,
    any_sampled: bool,
    top_n: int,
    lp_rows: Tensor | None,
    processing: Processing | None,
) -> tuple[Tensor, Tensor | None]:
    """Sample every row of ``logits [N, V]`` (bank ``rows [N]``; a penalized row's counts in ``history``, which
    counts the tokens sampled for it); logprobs with ``top_n`` alternatives when ``top_n >= 0``, for ``lp_rows``
    (None: all)."""
    x = logits
    if processing is not None:
        penalties = history if processing.penalties is not None else None
        assert penalties is not None or processing.penalties is None, "a penalized row sampled without a seed"
        counts, seen = penalties.gather(rows) if penalties is not None else (None, None)
        x = processing.apply(logits, counts, seen)
    tokens = sample_rows(x, table, any_sampled)  # [N]
    if processing is not None and processing.penalized_rows and history is not None:
        index = processing.penalized_index
        history.count(rows[index], tokens[index])
    if top_n < 0:
        return tokens, None
    base = processing.masked(logits) if processing is not None else logits  # a grammar's mask bans in logprobs too
    if lp_rows is not None:
        return tokens, logprob_columns(base[lp_rows], tokens[lp_rows], top_n)
    return tokens, logprob_columns(base, tokens, top_n)
