from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParameters(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "return_logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "min_p")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    return_logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., return_logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., min_p: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "max_tokens", "sampling", "stop_token_ids", "stop_strings", "exit_threshold", "ignore_eos", "replay_depths", "batch_tokens", "resume", "speculative", "priority", "structured_output")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    EXIT_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_DEPTHS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    max_tokens: int
    sampling: SamplingParameters
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    exit_threshold: float
    ignore_eos: bool
    replay_depths: _containers.RepeatedScalarFieldContainer[int]
    batch_tokens: bool
    resume: ResumeState
    speculative: bool
    priority: int
    structured_output: StructuredOutput
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParameters, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., exit_threshold: _Optional[float] = ..., ignore_eos: _Optional[bool] = ..., replay_depths: _Optional[_Iterable[int]] = ..., batch_tokens: _Optional[bool] = ..., resume: _Optional[_Union[ResumeState, _Mapping]] = ..., speculative: _Optional[bool] = ..., priority: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class ResumeState(_message.Message):
    __slots__ = ("token_ids", "depths")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    depths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., depths: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "text", "depth", "logprobs", "time_unix_nano")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    depth: int
    logprobs: TokenLogprobs
    time_unix_nano: int
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., depth: _Optional[int] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., time_unix_nano: _Optional[int] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    def __init__(self, tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "total_loop_steps", "resumed_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LOOP_STEPS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    total_loop_steps: int
    resumed_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., total_loop_steps: _Optional[int] = ..., resumed_tokens: _Optional[int] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("reason", "usage", "error", "text")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    usage: Usage
    error: str
    text: str
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("request_id", "token", "finish", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token: Token
    finish: Finish
    tokens: TokenBatch
    def __init__(self, request_id: _Optional[str] = ..., token: _Optional[_Union[Token, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., tokens: _Optional[_Union[TokenBatch, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "tokens", "finish")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    finish: Finish
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_input_tokens", "max_total_tokens", "max_num_seqs", "max_waiting", "max_running", "max_concurrent_rpcs")
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_RPCS_FIELD_NUMBER: _ClassVar[int]
    max_input_tokens: int
    max_total_tokens: int
    max_num_seqs: int
    max_waiting: int
    max_running: int
    max_concurrent_rpcs: int
    def __init__(self, max_input_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_waiting: _Optional[int] = ..., max_running: _Optional[int] = ..., max_concurrent_rpcs: _Optional[int] = ...) -> None: ...

class Counters(_message.Message):
    __slots__ = ("waiting", "running", "held_rows", "used_kv_blocks", "total_kv_blocks", "loop_steps", "recoveries", "recomputed")
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    HELD_ROWS_FIELD_NUMBER: _ClassVar[int]
    USED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOP_STEPS_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    running: int
    held_rows: int
    used_kv_blocks: int
    total_kv_blocks: int
    loop_steps: int
    recoveries: int
    recomputed: int
    def __init__(self, waiting: _Optional[int] = ..., running: _Optional[int] = ..., held_rows: _Optional[int] = ..., used_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., loop_steps: _Optional[int] = ..., recoveries: _Optional[int] = ..., recomputed: _Optional[int] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "architecture", "max_depth", "vocab_size", "kv_policy", "mode", "deployment", "limits", "counters", "healthy", "error", "kv_block_size", "dtype", "exit_rule", "exit_threshold", "exit_threshold_source", "early_exit", "exit_summary", "mean_served_depth", "synthetic_cost", "version", "served_model_names", "stage_pids", "recovery_seconds", "config_json", "config_digest", "stage_config_digests", "speculation")
    class StagePidsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class StageConfigDigestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_POLICY_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EXIT_RULE_FIELD_NUMBER: _ClassVar[int]
    EXIT_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    EXIT_THRESHOLD_SOURCE_FIELD_NUMBER: _ClassVar[int]
    EARLY_EXIT_FIELD_NUMBER: _ClassVar[int]
    EXIT_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    MEAN_SERVED_DEPTH_FIELD_NUMBER: _ClassVar[int]
    SYNTHETIC_COST_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    STAGE_PIDS_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CONFIG_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STAGE_CONFIG_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    max_depth: int
    vocab_size: int
    kv_policy: str
    mode: str
    deployment: str
    limits: Limits
    counters: Counters
    healthy: bool
    error: str
    kv_block_size: int
    dtype: str
    exit_rule: str
    exit_threshold: float
    exit_threshold_source: str
    early_exit: bool
    exit_summary: str
    mean_served_depth: float
    synthetic_cost: str
    version: str
    served_model_names: _containers.RepeatedScalarFieldContainer[str]
    stage_pids: _containers.ScalarMap[str, int]
    recovery_seconds: _containers.RepeatedScalarFieldContainer[float]
    config_json: str
    config_digest: str
    stage_config_digests: _containers.ScalarMap[str, str]
    speculation: Speculation
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., max_depth: _Optional[int] = ..., vocab_size: _Optional[int] = ..., kv_policy: _Optional[str] = ..., mode: _Optional[str] = ..., deployment: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ..., healthy: _Optional[bool] = ..., error: _Optional[str] = ..., kv_block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., exit_rule: _Optional[str] = ..., exit_threshold: _Optional[float] = ..., exit_threshold_source: _Optional[str] = ..., early_exit: _Optional[bool] = ..., exit_summary: _Optional[str] = ..., mean_served_depth: _Optional[float] = ..., synthetic_cost: _Optional[str] = ..., version: _Optional[str] = ..., served_model_names: _Optional[_Iterable[str]] = ..., stage_pids: _Optional[_Mapping[str, int]] = ..., recovery_seconds: _Optional[_Iterable[float]] = ..., config_json: _Optional[str] = ..., config_digest: _Optional[str] = ..., stage_config_digests: _Optional[_Mapping[str, str]] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("mode", "unsupported", "max_tokens", "draft_depth", "drafts", "accepted", "rejected", "wasted_loop_steps", "acceptance", "mean_draft_depth")
    MODE_FIELD_NUMBER: _ClassVar[int]
    UNSUPPORTED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DEPTH_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    WASTED_LOOP_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    MEAN_DRAFT_DEPTH_FIELD_NUMBER: _ClassVar[int]
    mode: str
    unsupported: str
    max_tokens: int
    draft_depth: int
    drafts: int
    accepted: int
    rejected: int
    wasted_loop_steps: int
    acceptance: float
    mean_draft_depth: float
    def __init__(self, mode: _Optional[str] = ..., unsupported: _Optional[str] = ..., max_tokens: _Optional[int] = ..., draft_depth: _Optional[int] = ..., drafts: _Optional[int] = ..., accepted: _Optional[int] = ..., rejected: _Optional[int] = ..., wasted_loop_steps: _Optional[int] = ..., acceptance: _Optional[float] = ..., mean_draft_depth: _Optional[float] = ...) -> None: ...
