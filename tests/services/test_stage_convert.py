"""Stage ops and results survive the protobuf round trip exactly."""

from __future__ import annotations

import pytest

from cdb_api.v1 import stage_pb2 as pb
from cdb_scheduler.plan import (
    Fence,
    HeadOp,
    HistorySeed,
    KVCopy,
    KVUpdate,
    LoopHead,
    LoopOp,
    PreludeOp,
    Stage,
    StageOp,
    StageResult,
)
from cdb_scheduler.sampling import LogitsProcessing, SamplingParams, TokenLogprobs
from services.transport.bank import BankSpec, CudaIpcHandle
from services.transport.convert import (
    bank_spec_from_pb,
    bank_spec_to_pb,
    op_from_pb,
    op_to_pb,
    result_from_pb,
    result_to_pb,
    role_from_pb,
    role_to_pb,
)

pytestmark = pytest.mark.timeout(10)

FENCES = (Fence(Stage.PRELUDE, 0), Fence(Stage.HEAD, 12345678901))
UPDATES = (KVUpdate(7, (1, 2, 3)), KVUpdate(9, (), reset=True))

OPS: list[StageOp] = [
    PreludeOp(0, (), (), (), rids=(), token_ids=(), positions=(), rows=(), init_seeds=()),
    PreludeOp(
        3,
        FENCES,
        UPDATES,
        (4, 5),
        rids=(7, 7, 9),
        token_ids=(1, 511, 0),
        positions=(0, 1, 0),
        rows=(64, 65, 2),
        init_seeds=(-1, 2**62 + 5, 0),
    ),
    LoopOp(1, FENCES, (), (), rids=(7,), positions=(3,), rows=(0,), steps=(2,)),
    LoopOp(
        2,
        (),
        UPDATES,
        (1,),
        rids=(7, 7),
        positions=(0, 1),
        rows=(64, 65),
        steps=(0, 0),
        prefill=True,
        num_steps=4,
        kv_copies=(KVCopy(7, 5, 1), KVCopy(9, 0, 3)),
    ),
    HeadOp(
        8,
        FENCES,
        UPDATES,
        (),
        rids=(7, 9, 11),
        positions=(10, 3, 0),
        rows=(0, 1, 2),
        sample=(True, False, True),
        sampling=(
            SamplingParams(),
            SamplingParams(temperature=0.7, top_k=40, top_p=0.95, seed=2**64 - 1, logprobs=5, return_logprob=True),
            SamplingParams(temperature=1e-7, top_p=1e-300, seed=12345),
        ),
        token_index=(0, 17, 3),
    ),
    HeadOp(  # a prefill head scoring the prompt (echo with prompt logprobs)
        9,
        (),
        (),
        (),
        rids=(7, 7, 7),
        positions=(0, 1, 2),
        rows=(64, 65, 66),
        sample=(False, False, True),
        sampling=(SamplingParams(logprobs=2),) * 3,
        token_index=(0, 0, 0),
        score_ids=(511, 0, -1),
    ),
    HeadOp(  # logits processing, and the history seed of a penalized request sampled here first
        10,
        (),
        (),
        (),
        rids=(7, 9),
        positions=(4, 2),
        rows=(0, 1),
        sample=(True, True),
        sampling=(
            SamplingParams(
                temperature=0.5,
                processing=LogitsProcessing(
                    presence_penalty=0.5,
                    frequency_penalty=-0.25,
                    repetition_penalty=1.3,
                    logit_bias=((3, -100.0), (17, 2.5)),
                    min_tokens=4,
                    stop_ids=(0, 2),
                ),
            ),
            SamplingParams(processing=LogitsProcessing(logit_bias=((5, 1.0),))),
        ),
        token_index=(1, 0),
        history=(HistorySeed(0, (5, 6, 7), (9,)),),
    ),
    LoopOp(
        11,
        (),
        (),
        (),
        rids=(7,),
        positions=(5,),
        rows=(0,),
        steps=(0,),
        head=LoopHead(
            rids=(7,),
            positions=(5,),
            rows=(0,),
            sampling=(SamplingParams(processing=LogitsProcessing(frequency_penalty=1.0)),),
            token_index=(2,),
            embed_ids=(-1,),
            history=(HistorySeed(0, (), (9, 4)),),
        ),
    ),
    LoopOp(  # a draft read: row 0's token sampled, its successor's input embedded into row 3
        12,
        (),
        (),
        (),
        rids=(7, 7),
        positions=(5, 6),
        rows=(0, 3),
        steps=(2, 0),
        head=LoopHead(
            rids=(7,),
            positions=(5,),
            rows=(0,),
            sampling=(SamplingParams(temperature=0.7, seed=3),),
            token_index=(2,),
            embed_ids=(-1,),
            embed_rows=(3,),
        ),
    ),
    HeadOp(  # structured output: masks of the sampled tokens (b"": none), one not sampled
        13,
        (),
        (),
        (),
        rids=(7, 9, 11),
        positions=(4, 2, 8),
        rows=(0, 1, 2),
        sample=(True, False, True),
        sampling=(SamplingParams(temperature=0.5, seed=3), SamplingParams(), SamplingParams()),
        token_index=(1, 0, 5),
        masks=(b"\x00\x21\xff\x01", b"", b""),
    ),
    LoopOp(  # a fused head with a mask on one of its rows
        14,
        (),
        (),
        (),
        rids=(7,),
        positions=(5,),
        rows=(0,),
        steps=(1,),
        head=LoopHead(
            rids=(7, 9),
            positions=(5, 6),
            rows=(1, 2),
            sampling=(SamplingParams(), SamplingParams(temperature=1.0, seed=9)),
            token_index=(2, 3),
            embed_ids=(-1, -1),
            masks=(b"", b"\x80\x00\x02"),
        ),
    ),
]


@pytest.mark.parametrize("op", OPS, ids=lambda op: f"{type(op).__name__}-{op.seq}")
def test_op_round_trip_is_exact(op: StageOp) -> None:
    msg = op_to_pb(op, traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    wire = pb.StageBatch.FromString(msg.SerializeToString())
    assert wire.traceparent.startswith("00-0af7")
    back = op_from_pb(wire)
    assert back == op
    assert type(back) is type(op)


@pytest.mark.parametrize("op", [op for op in OPS if not isinstance(op, PreludeOp)], ids=lambda op: f"{op.seq}")
def test_packed_columns_and_repeated_fields_read_as_the_same_op(op: StageOp) -> None:
    """The scheduler packs a loop op's and a head's columns; a batch with the repeated fields filled (another
    sender's) reads as the same op."""
    msg = op_to_pb(op)
    heads = [msg.head] if msg.HasField("head") else [msg.loop.head] if msg.loop.HasField("head") else []
    assert (msg.loop.columns if msg.HasField("loop") else msg.head.columns) or heads
    if msg.HasField("loop"):
        lp = msg.loop
        lp.rids[:], lp.positions[:], lp.rows[:], lp.steps[:] = op.rids, op.positions, op.rows, op.steps
        lp.columns = b""
    for h, src in zip(heads, [op if isinstance(op, HeadOp) else op.head]):
        assert src is not None and h.columns
        h.rids[:], h.positions[:], h.rows[:], h.token_index[:] = src.rids, src.positions, src.rows, src.token_index
        h.temperature[:] = [p.temperature for p in src.sampling]
        h.top_k[:], h.top_p[:] = [p.top_k for p in src.sampling], [p.top_p for p in src.sampling]
        h.seed[:] = [p.seed & (2**64 - 1) for p in src.sampling]
        h.logprobs[:], h.return_logprob[:] = (
            [p.logprobs for p in src.sampling],
            [p.return_logprob for p in src.sampling],
        )
        h.columns = b""
    assert op_from_pb(pb.StageBatch.FromString(msg.SerializeToString())) == op


def test_truncated_columns_fail_the_op_naming_them() -> None:
    loop = next(op for op in OPS if isinstance(op, LoopOp) and op.head is not None)
    msg = op_to_pb(loop)
    msg.loop.columns = msg.loop.columns[:-1]
    with pytest.raises(ValueError, match=r"loop columns: \d+ bytes is not a whole number of 32-byte tokens"):
        op_from_pb(msg)
    msg = op_to_pb(loop)
    msg.loop.head.columns = msg.loop.head.columns[:-3]
    with pytest.raises(ValueError, match=r"head columns: \d+ bytes is not a whole number of 81-byte tokens"):
        op_from_pb(msg)


def test_ping_is_not_an_op() -> None:
    msg = pb.StageBatch(seq=-1, ping=pb.Ping())
    with pytest.raises(ValueError, match="no stage work"):
        op_from_pb(msg)


RESULTS = [
    StageResult(Stage.PRELUDE, 0, 0.001),
    StageResult(Stage.LOOP, 5, 0.25, signals=(0.1, 1 / 3), lookahead=(0.2, 2 / 3)),
    StageResult(
        Stage.HEAD,
        7,
        1e-4,
        token_ids=(3, 4, 5),
        logprobs=(None, TokenLogprobs(-0.1), TokenLogprobs(-1 / 7, (1, 2), (-0.5, -2 / 3))),
    ),
    StageResult(Stage.LOOP, 9, 0.0, error="boom: shape mismatch"),
    StageResult(
        Stage.HEAD,
        10,
        1e-3,
        token_ids=(3,),
        logprobs=(None,),
        prompt_logprobs=(TokenLogprobs(-2.5, (4, 9), (-0.25, -1 / 3)), TokenLogprobs(-1e-9)),
    ),
]


@pytest.mark.parametrize("res", RESULTS, ids=lambda r: f"{r.stage.name}-{r.seq}")
def test_result_round_trip_is_exact(res: StageResult) -> None:
    wire = pb.StageReply.FromString(result_to_pb(res).SerializeToString())
    assert result_from_pb(wire) == res


def test_tokens_without_logprobs_travel_as_a_count() -> None:
    res = StageResult(Stage.LOOP, 3, 0.0, signals=(0.5,) * 4, token_ids=(7, 8, 9), logprobs=(None, None, None))
    wire = pb.StageReply.FromString(result_to_pb(res).SerializeToString())
    assert len(wire.logprobs) == 0 and wire.no_logprobs == 3
    assert result_from_pb(wire) == res
    some = StageResult(Stage.HEAD, 4, 0.0, token_ids=(1, 2), logprobs=(None, TokenLogprobs(-0.5)))
    wire = pb.StageReply.FromString(result_to_pb(some).SerializeToString())
    assert len(wire.logprobs) == 2 and wire.no_logprobs == 0 and result_from_pb(wire) == some


def test_roles_and_bank_specs() -> None:
    for stage in Stage:
        assert role_from_pb(role_to_pb(stage)) is stage
    with pytest.raises(ValueError):
        role_from_pb(pb.STAGE_ROLE_UNSPECIFIED)
    shm = BankSpec("shm", "cdb-bank-x", 80, 128, "bfloat16")
    assert bank_spec_from_pb(bank_spec_to_pb(shm)) == shm
    handle = CudaIpcHandle(1, b"\x00\x01h", 4096, 512, b"/torch_123", 8, b"\x02e", True)
    cuda = BankSpec("cuda_ipc", "", 4, 8, "float32", handle)
    assert bank_spec_from_pb(pb.BankSpec.FromString(bank_spec_to_pb(cuda).SerializeToString())) == cuda
    with pytest.raises(ValueError):
        bank_spec_from_pb(pb.BankSpec())
