"""Binary op records (``services.transport.records``): exact round trips, the message path for what a record does
not carry, refusal of malformed records, and the stages reading them off their rings."""

from __future__ import annotations

import struct
import types
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from cdb_api.v1 import stage_pb2 as pb
from cdb_scheduler.plan import HeadOp, LoopHead, LoopOp, PreludeOp, Stage, StageOp
from cdb_scheduler.sampling import SamplingParams
from services.transport import records, stage_service
from services.transport.convert import op_from_pb, op_to_pb
from services.transport.executor import GrpcExecutor
from tests.services.stage_harness import FAST, FakeWorker, fake_model, fake_setup, stage_servers
from tests.services.test_stage_convert import OPS
from tests.services.test_stage_protocol import loop_op, poll_all

pytestmark = pytest.mark.timeout(60)


def _needs_message(op: StageOp) -> bool:
    """What only a ``StageBatch`` carries: logits processing, penalty history, prompt scoring, draft embeds."""
    head = op.head if isinstance(op, LoopOp) else op if isinstance(op, HeadOp) else None
    if head is None:
        return False
    extra = bool(head.history) or any(p.processing for p in head.sampling)
    return extra or bool(getattr(head, "score_ids", ())) or bool(getattr(head, "embed_rows", ()))


@pytest.mark.parametrize("op", OPS, ids=lambda op: f"{type(op).__name__}-{op.seq}")
def test_a_record_reads_back_as_the_op_and_as_its_message_does(op: StageOp) -> None:
    record = records.encode(op, 2.5)
    if _needs_message(op):
        assert record is None  # it travels as a StageBatch
        return
    assert record is not None and records.is_record(bytes(record))
    back, fence_timeout_s = records.decode(bytes(record))
    assert back == op and type(back) is type(op)
    assert fence_timeout_s == 2.5
    assert back == op_from_pb(pb.StageBatch.FromString(op_to_pb(op).SerializeToString()))
    assert records.seq_of(bytes(record)) == op.seq


def test_a_wide_fused_loop_op_round_trips() -> None:
    loop = next(op for op in OPS if isinstance(op, LoopOp) and op.head is None and not op.prefill)
    n, h = 64, 26
    sampling = tuple(
        SamplingParams(temperature=0.5 * (i % 3), top_k=i, top_p=0.9, seed=2**64 - 1 - i) for i in range(h)
    )
    fused = replace(
        loop,
        rids=tuple(range(n)),
        positions=tuple(range(1000, 1000 + n)),
        rows=tuple(range(n)),
        steps=tuple(i % 4 for i in range(n)),
        head=LoopHead(
            rids=tuple(range(h)),
            positions=tuple(range(h)),
            rows=tuple(range(100, 100 + h)),
            sampling=sampling,
            token_index=tuple(range(h)),
            embed_ids=tuple(-1 if i % 2 else -2 for i in range(h)),
        ),
    )
    record = records.encode(fused)
    assert record is not None
    assert records.decode(bytes(record))[0] == fused


def test_a_message_never_reads_as_a_record() -> None:
    for op in OPS:
        wire = op_to_pb(op).SerializeToString()
        assert wire and not records.is_record(wire)


def test_an_integer_beyond_int64_takes_the_message_path_which_names_it() -> None:
    prelude = next(op for op in OPS if isinstance(op, PreludeOp) and op.rids)
    huge = replace(prelude, init_seeds=(2**63, 0, 0))
    assert records.encode(huge) is None
    with pytest.raises(ValueError, match="out of range"):
        op_to_pb(huge)


def _malformed(record: bytes) -> Iterator[tuple[str, bytes]]:
    yield "truncated", record[:-8]
    yield "extended", record + bytes(8)
    yield "another version", record[:1] + bytes([records.VERSION + 1]) + record[2:]
    yield "unknown kind", record[:2] + bytes([7]) + record[3:]
    fences_at = 24 + 8 * 2  # the header, then seq and num_steps: the fence count
    yield "counts that do not add up", record[:fences_at] + struct.pack("<q", 5) + record[fences_at + 8 :]
    fence = struct.pack("<qq", 2, 12345678901)  # (HEAD, seq) of the op's second fence
    yield "a fence on no stage", record.replace(fence, struct.pack("<qq", 9, 1), 1)
    yield "a fence on a negative stage", record.replace(fence, struct.pack("<qq", -1, 1), 1)
    yield "no header", record[:10]
    yield "settings rows of another layout", record[:12] + struct.pack("<I", 48) + record[16:]


@pytest.mark.parametrize("case", [c for c, _ in _malformed(b"")])
def test_a_malformed_record_is_refused_naming_what_is_wrong(case: str) -> None:
    op = next(op for op in OPS if isinstance(op, HeadOp) and not _needs_message(op))
    record = bytes(records.encode(op) or b"")
    assert op.fences and record
    bad = dict(_malformed(record))[case]
    with pytest.raises(ValueError, match="op record"):
        records.decode(bad)


def test_a_record_whose_masks_do_not_fill_its_tail_is_refused() -> None:
    op = next(op for op in OPS if isinstance(op, HeadOp) and op.masks)
    record = bytes(records.encode(op) or b"")
    assert record and records.decode(record)[0] == op
    for bad in (record[:-1], record + b"\x00"):
        with pytest.raises(ValueError, match="op record"):
            records.decode(bad)


@pytest.fixture
def ring_stages(tmp_path: Path) -> Iterator[GrpcExecutor]:
    FakeWorker.reset()
    with stage_servers(tmp_path, lambda s: fake_model(), worker_factory=FakeWorker, settings=FAST) as running:
        ex = GrpcExecutor(fake_setup(), {s: r.address for s, r in running.items()}, FAST)
        try:
            yield ex
        finally:
            ex.close()


def test_stages_on_rings_read_records_and_an_unreadable_one_fails_only_its_op(
    ring_stages: GrpcExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = ring_stages
    assert all(link.op_records for link in ex._links.values())
    ex.submit(loop_op(0, (0,)))
    assert [(r.seq, r.error) for r in poll_all(ex, 1)] == [(0, None)]
    assert FakeWorker.log == [(Stage.LOOP, 0)]
    encode = records.encode

    def cut_short(op: StageOp, fence_timeout_s: float = 0.0) -> bytearray | None:
        record = encode(op, fence_timeout_s)
        return record[:-8] if record is not None and op.seq == 1 else record  # its header still names seq 1

    monkeypatch.setattr(records, "encode", cut_short)
    ex.submit(loop_op(1, (0,)))
    ex.submit(loop_op(2, (0,)))
    failed, ok = poll_all(ex, 2)
    assert failed.seq == 1 and failed.error is not None and "op record" in failed.error
    assert (ok.seq, ok.error) == (2, None)
    assert ex.broken is None and FakeWorker.log == [(Stage.LOOP, 0), (Stage.LOOP, 2)]


def test_a_stage_that_reads_no_records_gets_messages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    older = types.SimpleNamespace(**{k: getattr(records, k) for k in ("is_record", "decode", "seq_of")}, VERSION=0)
    monkeypatch.setattr(stage_service, "records", older)  # a stage built before records: it answers 0
    FakeWorker.reset()
    with stage_servers(tmp_path, lambda s: fake_model(), worker_factory=FakeWorker, settings=FAST) as running:
        ex = GrpcExecutor(fake_setup(), {s: r.address for s, r in running.items()}, FAST)
        try:
            assert not any(link.op_records for link in ex._links.values())
            ex.submit(loop_op(0, (0,)))
            assert [(r.seq, r.error) for r in poll_all(ex, 1)] == [(0, None)]
        finally:
            ex.close()


def test_a_kept_settings_row_is_its_own_objects_and_the_seed_is_taken_modulo_2_64() -> None:
    """Settings rows are kept by object: another object with other settings never reads back as the first."""
    op = next(op for op in OPS if isinstance(op, HeadOp) and not _needs_message(op) and op.sampling)
    for seed in (2**64 + 5, 5, -1):
        fresh = replace(op, sampling=tuple(replace(p, seed=seed, top_k=seed % 7) for p in op.sampling))
        back = records.decode(bytes(records.encode(fresh) or b""))[0]
        assert isinstance(back, HeadOp)
        assert [(p.seed, p.top_k) for p in back.sampling] == [(seed % 2**64, seed % 7)] * len(op.sampling)
