"""``cdb.v1.Generation`` messages <-> engine calls: protobuf types stop here.

The engine sees ``RequestParams`` and emits ``TokenEvent`` / ``FinishEvent``; the handlers convert with these.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from cdb_api.v1 import generation_pb2 as pb
from cdb_engine.config import RequestParams, Structure, StructureKind, logits_processing
from cdb_engine.engine import Engine, FinishEvent, TokenEvent
from cdb_engine.errors import InvalidRequest
from cdb_engine.limits import describe
from cdb_engine.validation import schema_spec
from cdb_scheduler.request import FinishReason
from cdb_scheduler.sampling import SamplingParams, TokenLogprobs
from services.transport.executor import GrpcExecutor

_DEFAULT_MAX_TOKENS = RequestParams().max_tokens

_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


def requested_max_tokens(req: pb.GenerateRequest) -> int:
    """The request's ``max_tokens`` as the engine will read it (before validation)."""
    return req.max_tokens if req.HasField("max_tokens") else _DEFAULT_MAX_TOKENS


def request_to_engine(req: pb.GenerateRequest) -> tuple[str | list[int], RequestParams]:
    """The prompt (text or ids) and the engine's parameters of a request; values are validated by the engine,
    but for ``max_tokens`` 0 (the engine's prefill-only request: this API has no prompt logprobs to return)."""
    if requested_max_tokens(req) == 0:
        raise InvalidRequest("max_tokens", "must be >= 1, got 0")
    prompt: str | list[int] = list(req.token_ids.ids) if req.WhichOneof("prompt") == "token_ids" else req.text
    s = req.sampling
    sampling = SamplingParams(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p,
        seed=s.seed,
        logprobs=s.top_logprobs,
        return_logprob=s.return_logprobs,
        processing=logits_processing(
            s.presence_penalty,
            s.frequency_penalty,
            s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
            dict(s.logit_bias),
            s.min_tokens,
        ),
    )
    params = RequestParams(
        max_tokens=requested_max_tokens(req),
        sampling=sampling,
        stop_token_ids=tuple(req.stop_token_ids),
        stop_strings=tuple(req.stop_strings),
        exit_threshold=req.exit_threshold if req.HasField("exit_threshold") else None,
        ignore_eos=req.ignore_eos,
        replay_depths=tuple(req.replay_depths) if req.replay_depths else None,
        resume_tokens=tuple(req.resume.token_ids),
        resume_depths=tuple(req.resume.depths),
        speculative=req.speculative if req.HasField("speculative") else None,
        priority=req.priority,
        structure=structure_of(req),
    )
    return prompt, params


def structure_of(req: pb.GenerateRequest) -> Structure | None:
    """``GenerateRequest.structured_output`` as the engine's ``Structure`` (None: free text), its shape checked;
    ``field`` is its request path (``structured_output.json_schema``, ...), which the engine's refusals name."""
    so = req.structured_output
    kind = so.WhichOneof("kind") if req.HasField("structured_output") else None
    if kind is None or (kind == "json_object" and not so.json_object):
        return None
    field = f"structured_output.{kind}"
    if kind == "json_object":
        return Structure(StructureKind.JSON_OBJECT, "", field)
    if kind == "choice":
        if not so.choice.choices:
            raise InvalidRequest(field, "must hold at least one string")
        return Structure(StructureKind.CHOICE, json.dumps(list(so.choice.choices), ensure_ascii=False), field)
    text: str = getattr(so, kind)
    if not text:
        raise InvalidRequest(field, "must not be empty")
    if kind == "json_schema":
        return Structure(StructureKind.JSON, schema_spec(text, field), field)
    return Structure(StructureKind.REGEX if kind == "regex" else StructureKind.GRAMMAR, text, field)


def _logprobs_pb(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs)


def token_to_pb(ev: TokenEvent) -> pb.Token:
    tok = pb.Token(id=ev.token_id, text=ev.text, depth=ev.depth, time_unix_nano=ev.time_ns)
    if ev.logprobs is not None:
        tok.logprobs.CopyFrom(_logprobs_pb(ev.logprobs))
    return tok


def finish_to_pb(ev: FinishEvent) -> pb.Finish:
    usage = pb.Usage(
        prompt_tokens=ev.prompt_tokens,
        generated_tokens=ev.generated_tokens,
        total_loop_steps=ev.total_loop_steps,
        resumed_tokens=ev.resumed_tokens,
    )
    return pb.Finish(
        reason=_FINISH.get(ev.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        usage=usage,
        error=ev.error or "",
        text=ev.text,
    )


def tokens_to_pb(request_id: str, events: Sequence[TokenEvent]) -> pb.GenerateStreamResponse:
    """Several tokens of one request as one stream message (``GenerateRequest.batch_tokens``)."""
    msg = pb.GenerateStreamResponse(request_id=request_id)
    msg.tokens.tokens.extend(token_to_pb(ev) for ev in events)
    return msg


def event_to_pb(ev: TokenEvent | FinishEvent) -> pb.GenerateStreamResponse:
    if isinstance(ev, TokenEvent):
        return pb.GenerateStreamResponse(request_id=ev.request_id, token=token_to_pb(ev))
    return pb.GenerateStreamResponse(request_id=ev.request_id, finish=finish_to_pb(ev))


def info_to_pb(
    engine: Engine,
    deployment: str,
    max_concurrent_rpcs: int,
    extra_error: str | None = None,
    executor: GrpcExecutor | None = None,
) -> Any:
    """``InfoResponse`` from the engine's configuration, limits and live counters (and the stage processes and
    recoveries of ``executor``)."""
    cfg, mc, limits = engine.config, engine.model_config, engine.limits
    st = engine.stats()
    error = st.error or extra_error
    hist = dict(engine.sched_stats.depth_hist)  # a copy: the engine thread adds to it
    served = sum(hist.values())
    return pb.InfoResponse(
        model=cfg.model,
        architecture=mc.arch,
        max_depth=limits.max_depth,
        vocab_size=mc.vocab_size,
        kv_policy=cfg.kv_policy,
        mode=cfg.mode,
        deployment=deployment,
        limits=pb.Limits(
            max_input_tokens=limits.max_input_tokens,
            max_total_tokens=limits.max_total_tokens,
            max_num_seqs=cfg.max_num_seqs,
            max_waiting=cfg.max_waiting,
            max_running=cfg.max_num_seqs + cfg.max_waiting,
            max_concurrent_rpcs=max_concurrent_rpcs,
        ),
        counters=pb.Counters(
            waiting=st.waiting,
            running=st.running,
            held_rows=st.held_rows,
            used_kv_blocks=st.used_kv_blocks,
            total_kv_blocks=st.total_kv_blocks,
            loop_steps=st.loop_steps,
            recoveries=st.recoveries,
            recomputed=st.recomputed,
        ),
        healthy=st.healthy and error is None,
        error=error or "",
        kv_block_size=cfg.kv_block_size,
        dtype=cfg.dtype,
        synthetic_cost=cfg.synthetic_cost,
        exit_rule=limits.exit_rule,
        exit_threshold=limits.exit_threshold,
        exit_threshold_source=limits.threshold_source,
        early_exit=limits.early_exit,
        exit_summary=describe(limits),
        mean_served_depth=sum(d * n for d, n in hist.items()) / served if served else 0.0,
        stage_pids=executor.stage_pids() if executor is not None else {},
        recovery_seconds=list(executor.recovery_s[-100:]) if executor is not None else [],
        speculation=_speculation(engine),
    )


def _speculation(engine: Engine) -> Any:
    st, cfg = engine.sched_stats, engine.scheduler.cfg
    return pb.Speculation(
        mode=engine.config.speculative,
        unsupported=engine.limits.no_speculation,
        max_tokens=cfg.spec_max_tokens,
        draft_depth=cfg.spec_depth,
        drafts=st.spec_drafts,
        accepted=st.spec_accepted,
        rejected=st.spec_rejected,
        wasted_loop_steps=st.spec_wasted_steps,
        acceptance=st.spec_acceptance,
        mean_draft_depth=st.spec_draft_depth_sum / st.spec_drafts if st.spec_drafts else 0.0,
    )
