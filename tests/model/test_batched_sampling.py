"""The stages' batched sampler against the float64 oracle (``cdb_model.sampling``): the same token for every row,
whatever else is in the batch; the same logprobs; the distribution the parameters ask for."""

from __future__ import annotations

import math

import torch

from cdb_model.batched_sampling import SamplingColumns, logprob_columns, sample_rows, unpack_logprobs
from cdb_model.sampling import sample
from cdb_scheduler.sampling import LogitsProcessing, SamplingParams

CPU = torch.device("cpu")


def batched(logits: torch.Tensor, params: list[SamplingParams], index: list[int]) -> list[int]:
    cols = SamplingColumns.build(params, index, CPU)
    return sample_rows(logits, cols.table, cols.any_sampled).tolist()


def mixed_params(n: int) -> list[SamplingParams]:
    kinds = [
        SamplingParams(),  # greedy
        SamplingParams(temperature=1.0, seed=3),  # no filter: vocabulary order
        SamplingParams(temperature=0.7, top_k=5, seed=11),
        SamplingParams(temperature=1.3, top_p=0.8, seed=5),
        SamplingParams(temperature=0.9, top_k=12, top_p=0.6, seed=8),
        SamplingParams(temperature=2.0, top_p=1e-9, seed=1),  # nucleus of one
        SamplingParams(temperature=1.0, top_k=1000, seed=2),  # k beyond the vocabulary
        SamplingParams(temperature=1.1, min_p=0.1, seed=9),  # min-p alone: vocabulary order, the tail dropped
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=10),
    ]
    return [kinds[i % len(kinds)] for i in range(n)]


def test_every_row_draws_the_oracles_token_in_float64() -> None:
    gen = torch.Generator().manual_seed(0)
    agree = 0
    for trial in range(30):
        logits = (torch.randn(18, 97, generator=gen, dtype=torch.float64) * 2.5).float()
        params = mixed_params(18)
        index = [trial * 18 + i for i in range(18)]
        expected, _ = sample(logits, params, index)
        assert batched(logits, params, index) == expected
        agree += 18
    assert agree == 540


def test_min_p_one_keeps_only_the_most_likely_token_and_drops_the_tail() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 80, generator=gen) * 3
    index = list(range(6))
    greedy = logits.argmax(dim=-1).tolist()
    for seed in range(5):
        params = [SamplingParams(temperature=1.5, min_p=1.0, seed=seed)] * 6
        assert batched(logits, params, index) == greedy  # min_p 1: the argmax, whatever the draw
    probs = torch.softmax(logits.double(), dim=-1)
    for seed in range(20):
        params = [SamplingParams(temperature=1.0, min_p=0.3, seed=seed)] * 6
        for row, token in enumerate(batched(logits, params, index)):
            assert probs[row, token] >= 0.3 * probs[row].max()


def test_greedy_is_the_argmax_of_float32_logits() -> None:
    logits = torch.randn(9, 300, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams()] * 9
    assert batched(logits, params, list(range(9))) == logits.argmax(dim=-1).tolist()


def test_a_rows_token_does_not_depend_on_its_batch() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 64, generator=gen)
    params, index = mixed_params(8), [4, 0, 9, 9, 2, 7, 1, 3]
    together = batched(logits, params, index)
    alone = [batched(logits[i : i + 1], [params[i]], [index[i]])[0] for i in range(8)]
    assert together == alone
    assert batched(logits.flip(0), params[::-1], index[::-1])[::-1] == together


def test_logprobs_and_alternatives_match_the_oracle() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(return_logprob=True),
        SamplingParams(temperature=1.0, seed=4, logprobs=3),
        SamplingParams(),
        SamplingParams(temperature=0.5, top_k=4, seed=6, logprobs=1, return_logprob=True),
        SamplingParams(logprobs=5),
    ]
    index = [0, 1, 2, 3, 4]
    tokens, expected = sample(logits, params, index)
    cols = SamplingColumns.build(params, index, CPU)
    got_tokens = sample_rows(logits, cols.table, cols.any_sampled)
    assert got_tokens.tolist() == tokens
    rows = list(cols.logprob_rows)
    packed = logprob_columns(logits[rows], got_tokens[rows], cols.top_n).tolist()
    got = unpack_logprobs(packed, params, rows, len(params))
    assert got[2] is None and expected[2] is None
    for g, e in zip(got, expected, strict=True):
        if e is None:
            continue
        assert g is not None
        assert math.isclose(g.logprob, e.logprob, rel_tol=0, abs_tol=1e-12)
        assert g.top_ids == e.top_ids
        assert all(math.isclose(a, b, abs_tol=1e-12) for a, b in zip(g.top_logprobs, e.top_logprobs, strict=True))


def test_draws_follow_the_filtered_distribution() -> None:
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    n = 3000
    logits = probs.log()[None].expand(n, -1).contiguous()
    p = SamplingParams(temperature=1.0, top_k=3, seed=21)
    counts = torch.bincount(torch.tensor(batched(logits, [p] * n, list(range(n)))), minlength=5).tolist()
    assert counts[0] == counts[2] == 0  # outside the top 3
    kept = {1: 0.4 / 0.85, 3: 0.3 / 0.85, 4: 0.15 / 0.85}
    for token, q in kept.items():
        assert abs(counts[token] / n - q) < 4 * math.sqrt(q * (1 - q) / n)


def test_logits_processing_matches_the_oracle_row_by_row() -> None:
    gen = torch.Generator().manual_seed(7)
    n, vocab = 8, 40
    logits = torch.randn(n, vocab, generator=gen) * 3
    prompts = [[1, 2, 3], [4], [5, 5, 6], [], [7, 8], [9], [10, 11], [12]]
    outputs = [[2, 2, 30], [4, 4, 4, 4], [], [0, 1], [8], [9, 9], [], [13]]
    procs = [
        LogitsProcessing(repetition_penalty=1.5),
        LogitsProcessing(frequency_penalty=0.7, presence_penalty=0.3),
        LogitsProcessing(logit_bias=((3, 5.0), (4, -100.0))),
        LogitsProcessing(min_tokens=5, stop_ids=(0, 1, 2)),
        LogitsProcessing(repetition_penalty=0.8, frequency_penalty=-0.5, logit_bias=((8, 1.0),)),
        None,
        LogitsProcessing(presence_penalty=2.0),
        LogitsProcessing(min_tokens=1, stop_ids=(13,), repetition_penalty=1.2),
    ]
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.9, top_k=10 if i % 3 else 0, seed=i, processing=p)
        for i, p in enumerate(procs)
    ]
    index = [len(o) for o in outputs]
    expected, _ = sample(logits, params, index, list(zip(prompts, outputs, strict=True)))
    counts = torch.zeros(n, vocab, dtype=torch.int32)
    seen = torch.zeros(n, vocab, dtype=torch.bool)
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        for t in output:
            counts[i, t] += 1
        seen[i, prompt] = True
    cols = SamplingColumns.build(params, index, CPU)
    assert cols.processing is not None
    x = cols.processing.apply(logits, counts, seen | (counts > 0))
    assert sample_rows(x, cols.table, cols.any_sampled).tolist() == expected
    # The penalties bite: greedy rows with a penalty or a bias differ from the plain argmax somewhere.
    assert (
        expected
        != sample(
            logits, [SamplingParams(temperature=p.temperature, top_k=p.top_k, seed=p.seed) for p in params], index
        )[0]
    )


def test_an_op_without_min_p_carries_no_min_p_row() -> None:
    """min-p costs an op nothing unless a row asks for it: its table has the fifth row only then."""
    plain = [SamplingParams(temperature=1.0, seed=1), SamplingParams()]
    assert SamplingColumns.build(plain, [0, 1], CPU).table.shape == (4, 2)  # type: ignore[union-attr]
    mixed = [SamplingParams(temperature=1.0, seed=1, min_p=0.2), SamplingParams()]
    table = SamplingColumns.build(mixed, [0, 1], CPU).table
    assert table is not None and table.shape == (5, 2) and table[4].tolist() == [0.2, 0.0]
