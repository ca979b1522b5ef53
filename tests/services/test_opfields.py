"""The op field tables (``services.transport.opfields``) name every per-token column and sampling setting of the
plan dataclasses, so a new one fails here until it is declared where both codecs read it."""

from __future__ import annotations

import dataclasses

import pytest

from cdb_scheduler.plan import HeadOp, LoopHead, LoopOp, OpBase, PreludeOp
from cdb_scheduler.sampling import SamplingParams
from services.transport.opfields import (
    HEAD_OP_COLUMNS,
    LOOP_COLUMNS,
    LOOP_HEAD_COLUMNS,
    PRELUDE_COLUMNS,
    SAMPLING_NAMES,
    sampling_params,
)

pytestmark = pytest.mark.timeout(10)

# What each codec carries itself: the op's header fields and what only a message carries.
_OWN = {
    PreludeOp: set(),
    LoopOp: {"prefill", "num_steps", "kv_copies", "head"},
    HeadOp: {"sampling", "embed", "score_ids", "history", "masks"},
    LoopHead: {"sampling", "history", "embed_rows", "masks"},
}
_TABLE = {PreludeOp: PRELUDE_COLUMNS, LoopOp: LOOP_COLUMNS, HeadOp: HEAD_OP_COLUMNS, LoopHead: LOOP_HEAD_COLUMNS}


@pytest.mark.parametrize("cls", list(_TABLE), ids=lambda c: c.__name__)
def test_every_field_of_an_op_is_a_table_column_or_a_codec_s_own(cls: type) -> None:
    common = {f.name for f in dataclasses.fields(OpBase)} | {"stage"}
    fields = {f.name for f in dataclasses.fields(cls)} - common
    assert fields == set(_TABLE[cls]) | _OWN[cls]
    assert len(set(_TABLE[cls])) == len(_TABLE[cls])


def test_the_sampling_table_names_every_setting_and_builds_one_shared_object() -> None:
    assert set(SAMPLING_NAMES) == {f.name for f in dataclasses.fields(SamplingParams)} - {"processing"}
    key = (0.5, 4, 0.9, 0.05, 2**64 - 1, 2, True)
    params = sampling_params(key)
    want = SamplingParams(
        temperature=0.5, top_k=4, top_p=0.9, min_p=0.05, seed=2**64 - 1, logprobs=2, return_logprob=True
    )
    assert params == want
    assert sampling_params(key) is params
