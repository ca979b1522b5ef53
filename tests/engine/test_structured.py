"""Structured output in the engine: every constrained output follows its structure; without forced skips the tokens
and depths are the sequential reference's under the same masks; with them, a forced token's position exits at the
minimum depth, and a row's result is the same alone or in any batch; masks hold against logit bias and penalties, and
logprobs are computed with them."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest

from cdb_engine.config import EngineConfig, RequestParams, Structure, StructureKind
from cdb_engine.engine import Engine
from cdb_engine.errors import InvalidRequest
from cdb_engine.inprocess import shared_model_factory
from cdb_engine.limits import build_policy
from cdb_engine.prepare import RequestPreparer
from cdb_model.kv import KVLayout, KVPolicy
from cdb_model.reference import reference_generate
from cdb_scheduler.exit_policy import FixedDepth
from cdb_scheduler.sampling import SamplingParams

from .test_equivalence import model64

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["lord", "king", "prophet"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
STRUCTURES = {
    "json": Structure(StructureKind.JSON, json.dumps(SCHEMA)),
    "regex": Structure(StructureKind.REGEX, r"[a-z]{2,5}-\d{2}( [A-Z]{1,3})?"),
    "choice": Structure(StructureKind.CHOICE, json.dumps(["in the beginning", "and god said", "amen"])),
    "grammar": Structure(StructureKind.GRAMMAR, 'start: "(" expr ")"\nexpr: NUM | NUM "+" NUM\nNUM: /[0-9]{1,3}/'),
}
BASE = EngineConfig(model="ouro-tiny", dtype="float64", max_num_seqs=8, num_kv_blocks=256, kv_block_size=8)
PROMPTS = ([5, 6, 7, 8, 9], [40, 41, 42], [100, 3, 77, 12, 9, 200])
GREEDY, SEEDED = SamplingParams(), SamplingParams(temperature=1.0, top_p=0.95, seed=7)


def follows(structure: Structure, text: str) -> bool:
    if structure.kind == StructureKind.JSON:
        jsonschema.validate(json.loads(text), json.loads(structure.spec))
        return True
    if structure.kind == StructureKind.REGEX:
        return re.fullmatch(structure.spec, text) is not None
    if structure.kind == StructureKind.CHOICE:
        return text in json.loads(structure.spec)
    return re.fullmatch(r"\(\d{1,3}(\+\d{1,3})?\)", text) is not None


def generate(cfg: EngineConfig, work: list[tuple[list[int], RequestParams]]) -> list:
    with Engine(cfg, shared_model_factory(model64(cfg.model))) as eng:
        outs = eng.generate([p for p, _ in work], [r for _, r in work])
        stats = eng.stats()
        assert stats.held_rows == 0 and stats.used_kv_blocks == 0, "resources held after drain"
        return outs


def constrained(structure: Structure, sampling: SamplingParams = GREEDY, **extra: object) -> RequestParams:
    return RequestParams(max_tokens=96, sampling=sampling, structure=structure, **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("name", list(STRUCTURES))
def test_every_constrained_output_follows_its_structure(name: str, sampling: SamplingParams) -> None:
    structure = STRUCTURES[name]
    work = [(p, constrained(structure, replace(sampling, seed=sampling.seed + i))) for i, p in enumerate(PROMPTS)]
    for out in generate(BASE, work):
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        assert follows(structure, out.text), out.text


@pytest.mark.parametrize("fuse", [True, False], ids=["fused-head", "head-op"])
@pytest.mark.parametrize("kv_policy", [p.value for p in KVPolicy])
def test_without_forced_skip_tokens_and_depths_equal_the_sequential_reference(kv_policy: str, fuse: bool) -> None:
    mode = "full-depth" if kv_policy == KVPolicy.DEPTH_INDEXED else "cdb"
    cfg = replace(BASE, kv_policy=kv_policy, mode=mode, forced_skip=False, fuse_loop_head=fuse, exit_threshold=0.5)
    if kv_policy == KVPolicy.FIRST_THEN_SHARED:
        cfg = replace(cfg, min_depth=cfg.kv_shared_after)
    work = [
        (PROMPTS[i % 3], constrained(s, replace(samp, seed=i)))
        for i, (s, samp) in enumerate((s, samp) for s in STRUCTURES.values() for samp in (GREEDY, SEEDED))
    ]
    outs = generate(cfg, work)
    model, prep = model64(cfg.model), RequestPreparer.of(cfg)
    layout = KVLayout(KVPolicy(kv_policy), prep.limits.max_depth, cfg.kv_shared_after)
    for (prompt, params), out in zip(work, outs):
        assert params.structure is not None
        ref = reference_generate(
            model,
            prompt,
            max_new_tokens=params.max_tokens,
            policy=FixedDepth(4, 4) if mode == "full-depth" else build_policy(prep.limits, None),
            kv_layout=layout,
            sampling=params.sampling,
            stop_token_ids=prep.model_config.stop_token_ids,
            guide=prep.grammars.guide(params.structure),
        )
        assert (out.token_ids, out.depths) == (ref.tokens, ref.depths)


def forced_positions(prep: RequestPreparer, structure: Structure, tokens: list[int]) -> list[bool]:
    """Whether each token was forced by the grammar, replayed through a fresh guide."""
    guide, forced = prep.grammars.guide(structure), []
    for i, t in enumerate(tokens):
        forced.append(guide.forced(i) >= 0)
        assert guide.accept(i, t), guide.error
    return forced


def test_a_forced_tokens_position_exits_at_the_minimum_depth() -> None:
    """A forced token whose predecessor was forced too is known at its position's spawn: depth 1 (the minimum);
    one after a sampled token is known by its step ``loop_pipeline_depth``: at most that + 1. And forced positions
    cost at most half the loop steps of free ones."""
    work = [(p, constrained(STRUCTURES["json"], replace(SEEDED, seed=i))) for i, p in enumerate(PROMPTS)]
    prep = RequestPreparer.of(BASE)
    forced_steps, free_steps = [], []
    for out in generate(BASE, work):
        forced = forced_positions(prep, STRUCTURES["json"], out.token_ids)
        for i in range(1, len(out.token_ids)):
            if forced[i] and forced[i - 1]:
                assert out.depths[i] == 1, (i, out.depths)
            elif forced[i]:
                assert out.depths[i] <= BASE.loop_pipeline_depth + 1
            (forced_steps if forced[i] else free_steps).append(out.depths[i])
    assert forced_steps and free_steps
    assert sum(forced_steps) / len(forced_steps) <= 0.5 * sum(free_steps) / len(free_steps)


def test_a_constrained_rows_result_is_the_same_alone_and_in_a_batch() -> None:
    """Tokens and depths (forced skips on) of each request alone, and among seven others of every kind, sampled and
    greedy, constrained and not."""
    work = [(PROMPTS[i % 3], constrained(s, replace(SEEDED, seed=i))) for i, s in enumerate(STRUCTURES.values())]
    work += [(PROMPTS[i % 3], RequestParams(max_tokens=20, sampling=replace(SEEDED, seed=i))) for i in range(4)]
    together = generate(BASE, work)
    for item, out in zip(work, together):
        (alone,) = generate(BASE, [item])
        assert (alone.token_ids, alone.depths) == (out.token_ids, out.depths)


def test_the_mask_holds_against_logit_bias_and_penalties_and_logprobs_are_masked() -> None:
    """A +100 bias on a token the grammar never allows there ('x' in a regex of digits) is never sampled; with a
    repetition penalty the output still matches; each logprob's alternatives are allowed tokens, and a forced
    token's logprob is 0."""
    prep = RequestPreparer.of(BASE)
    x = prep.tokenizer.encode("x")[0]
    biased = replace(SEEDED, processing=replace(SEEDED.processing or _proc(), logit_bias=((x, 100.0),)))
    penalized = replace(GREEDY, processing=replace(_proc(), repetition_penalty=1.5, presence_penalty=0.5))
    digits = Structure(StructureKind.REGEX, r"\d{4}-\d{2}")
    work = [
        (PROMPTS[0], constrained(digits, replace(biased, logprobs=3, return_logprob=True))),
        (PROMPTS[1], constrained(digits, replace(penalized, logprobs=3, return_logprob=True))),
    ]
    for out in generate(BASE, work):
        assert re.fullmatch(r"\d{4}-\d{2}", out.text), out.text
        assert x not in out.token_ids
        guide = prep.grammars.guide(digits)
        for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            mask = guide.mask(i)
            allowed = {t for t in range(8 * len(mask)) if mask[t >> 3] >> (t & 7) & 1}
            assert lp is not None and token in allowed
            finite = [t for t, v in zip(lp.top_ids, lp.top_logprobs) if v > float("-inf")]
            assert finite and set(finite) <= allowed, (i, finite)
            forced = len(allowed) == 1 or allowed <= set(prep.model_config.stop_token_ids)
            assert (lp.logprob == 0.0) == forced  # a forced token ('-', the end) has logprob 0
            assert guide.accept(i, token)


def _proc():  # type: ignore[no-untyped-def]
    from cdb_scheduler.sampling import LogitsProcessing

    return LogitsProcessing()


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ('{"type": "object", "properties": {"a": {"type": "strin"}}}', "strin"),
        ("{not json", ""),
        ('{"type": "string", "format": "no-such-format"}', "format"),
        ('{"$ref": "https://example.com/schema.json"}', ""),
        ("x" * (64 * 1024 + 1), "65536"),
    ],
    ids=["unknown-type", "not-json", "unknown-format", "external-ref", "too-long"],
)
def test_a_schema_that_cannot_be_enforced_is_refused_naming_its_field(spec: str, why: str) -> None:
    prep = RequestPreparer.of(BASE)
    structure = Structure(StructureKind.JSON, spec, field="response_format.json_schema.schema")
    for _ in range(2):  # the second refusal comes from the cache
        with pytest.raises(InvalidRequest) as err:
            prep.validate([5, 6], RequestParams(structure=structure))
        assert err.value.field == "response_format.json_schema.schema"
        assert why in err.value.message


@pytest.mark.parametrize(
    ("extra", "field"),
    [({"ignore_eos": True}, "ignore_eos"), ({"speculative": True}, "speculative")],
)
def test_what_structured_output_cannot_combine_with_is_refused_naming_it(extra: dict, field: str) -> None:
    prep = RequestPreparer.of(BASE)
    with pytest.raises(InvalidRequest) as err:
        prep.validate([5, 6], constrained(STRUCTURES["regex"], **extra))
    assert err.value.field == field


def test_a_bad_regex_or_grammar_is_refused_naming_its_field() -> None:
    prep = RequestPreparer.of(BASE)
    for structure in (
        Structure(StructureKind.REGEX, "[a-", field="structured_outputs.regex"),
        Structure(StructureKind.GRAMMAR, "start: undefined_rule", field="guided_grammar"),
        Structure(StructureKind.CHOICE, "[]", field="guided_choice"),
    ):
        with pytest.raises(InvalidRequest) as err:
            prep.validate([5, 6], RequestParams(structure=structure))
        assert err.value.field == structure.field


def test_synthetic_stages_sample_within_the_masks() -> None:
    """Synthetic stages (modelled device time, seeded draws) pick each constrained token among the ids its mask
    allows: every output follows its structure, through the records the stages read."""
    cfg = EngineConfig(model="ouro-tiny", synthetic_cost="loop=20:0:0,head=10:0:0", max_num_seqs=8)
    work = [
        (p, constrained(s, replace(SEEDED, seed=i))) for i, (p, s) in enumerate(zip(PROMPTS * 2, STRUCTURES.values()))
    ]
    with Engine(cfg) as eng:
        outs = eng.generate([p for p, _ in work], [r for _, r in work])
    for (_, params), out in zip(work, outs):
        assert params.structure is not None and out.finish_reason == "stop", out.text
        assert follows(params.structure, out.text), out.text


def test_one_guide_thread_walks_the_grammars_of_every_engine_in_a_process() -> None:
    import threading

    for _ in range(3):
        guide = RequestPreparer.of(BASE).grammars.guide(STRUCTURES["regex"])
        bits = int.from_bytes(guide.mask(0), "little")
        assert guide.accept(0, (bits & -bits).bit_length() - 1)  # the lowest id allowed: walked on the thread
        assert guide.mask_now(1, True)
    assert sum(t.name == "cdb-guides" for t in threading.enumerate()) == 1


def test_a_resumed_constrained_stream_continues_exactly_as_the_unbroken_one() -> None:
    """Tokens and depths after the resumed ones are the unbroken stream's: whether a token is forced, and so its
    depth, is a function of the grammar, not of when its walk ended or of the tokens arriving as a resume. Cut where
    it shows: before a forced token that follows a sampled one (known late in the unbroken stream, at once in the
    resumed one) and served deeper than the minimum."""
    params = constrained(STRUCTURES["json"], replace(SEEDED, seed=4))
    (whole,) = generate(BASE, [(PROMPTS[0], params)])
    forced = forced_positions(RequestPreparer.of(BASE), STRUCTURES["json"], whole.token_ids)
    cuts = [i for i in range(1, len(forced)) if forced[i] and not forced[i - 1] and whole.depths[i] > 1]
    assert cuts, "the stream should hold a late-known forced token"
    for cut in cuts[:3]:
        resume = replace(params, resume_tokens=tuple(whole.token_ids[:cut]), resume_depths=tuple(whole.depths[:cut]))
        (rest,) = generate(BASE, [(PROMPTS[0], resume)])
        assert (rest.token_ids, rest.depths) == (whole.token_ids[cut:], whole.depths[cut:])


def test_a_resume_the_grammar_refuses_is_refused_naming_resume() -> None:
    prep = RequestPreparer.of(BASE)
    x = prep.tokenizer.encode("x")[0]
    params = constrained(STRUCTURES["json"], resume_tokens=(x,), resume_depths=(2,))
    with pytest.raises(InvalidRequest) as err:
        prep.request(0, prep.validate(PROMPTS[0], params), params)
    assert err.value.field == "resume"


def test_preempted_constrained_requests_are_recomputed_exactly() -> None:
    """A KV pool too small for the batch preempts (and recomputes) requests: every constrained one's tokens and
    depths are those of a pool that holds them all."""
    work = [(PROMPTS[i % 3], constrained(s, replace(SEEDED, seed=i))) for i, s in enumerate(STRUCTURES.values())] * 2
    work = [(p, replace(r, max_tokens=40)) for p, r in work]
    small = replace(BASE, kv_block_size=4, max_total_tokens=48, prefill_chunk_size=8, prefill_token_budget=16)
    roomy = generate(small, work)
    with Engine(replace(small, num_kv_blocks=12), shared_model_factory(model64("ouro-tiny"))) as eng:
        tight = eng.generate([p for p, _ in work], [r for _, r in work])
        assert eng.sched_stats.preemptions > 0, "the pool should be too small"
    assert [(o.token_ids, o.depths) for o in tight] == [(o.token_ids, o.depths) for o in roomy]
