from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StageRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STAGE_ROLE_UNSPECIFIED: _ClassVar[StageRole]
    STAGE_ROLE_PRELUDE: _ClassVar[StageRole]
    STAGE_ROLE_LOOP: _ClassVar[StageRole]
    STAGE_ROLE_HEAD: _ClassVar[StageRole]

class BankKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BANK_KIND_UNSPECIFIED: _ClassVar[BankKind]
    BANK_KIND_SHM: _ClassVar[BankKind]
    BANK_KIND_CUDA_IPC: _ClassVar[BankKind]
STAGE_ROLE_UNSPECIFIED: StageRole
STAGE_ROLE_PRELUDE: StageRole
STAGE_ROLE_LOOP: StageRole
STAGE_ROLE_HEAD: StageRole
BANK_KIND_UNSPECIFIED: BankKind
BANK_KIND_SHM: BankKind
BANK_KIND_CUDA_IPC: BankKind

class CudaIpcHandle(_message.Message):
    __slots__ = ("device", "handle", "size_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class BankSpec(_message.Message):
    __slots__ = ("kind", "name", "rows", "width", "dtype", "cuda")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    kind: BankKind
    name: str
    rows: int
    width: int
    dtype: str
    cuda: CudaIpcHandle
    def __init__(self, kind: _Optional[_Union[BankKind, str]] = ..., name: _Optional[str] = ..., rows: _Optional[int] = ..., width: _Optional[int] = ..., dtype: _Optional[str] = ..., cuda: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class FenceBoardSpec(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class KVSpec(_message.Message):
    __slots__ = ("policy", "max_depth", "shared_after", "num_blocks", "block_size")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    SHARED_AFTER_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    policy: str
    max_depth: int
    shared_after: int
    num_blocks: int
    block_size: int
    def __init__(self, policy: _Optional[str] = ..., max_depth: _Optional[int] = ..., shared_after: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class ConfigureRequest(_message.Message):
    __slots__ = ("role", "model", "dtype", "bank", "fences", "kv", "token_bank", "holder", "device", "rings")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BANK_FIELD_NUMBER: _ClassVar[int]
    FENCES_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BANK_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RINGS_FIELD_NUMBER: _ClassVar[int]
    role: StageRole
    model: str
    dtype: str
    bank: BankSpec
    fences: FenceBoardSpec
    kv: KVSpec
    token_bank: BankSpec
    holder: str
    device: str
    rings: StageRings
    def __init__(self, role: _Optional[_Union[StageRole, str]] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ..., bank: _Optional[_Union[BankSpec, _Mapping]] = ..., fences: _Optional[_Union[FenceBoardSpec, _Mapping]] = ..., kv: _Optional[_Union[KVSpec, _Mapping]] = ..., token_bank: _Optional[_Union[BankSpec, _Mapping]] = ..., holder: _Optional[str] = ..., device: _Optional[str] = ..., rings: _Optional[_Union[StageRings, _Mapping]] = ...) -> None: ...

class StageRings(_message.Message):
    __slots__ = ("ops", "replies", "doorbell")
    OPS_FIELD_NUMBER: _ClassVar[int]
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_FIELD_NUMBER: _ClassVar[int]
    ops: str
    replies: str
    doorbell: str
    def __init__(self, ops: _Optional[str] = ..., replies: _Optional[str] = ..., doorbell: _Optional[str] = ...) -> None: ...

class ConfigureResponse(_message.Message):
    __slots__ = ("role", "model", "architecture", "bank_width", "device", "process", "config_digest", "op_records")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    BANK_WIDTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_DIGEST_FIELD_NUMBER: _ClassVar[int]
    OP_RECORDS_FIELD_NUMBER: _ClassVar[int]
    role: StageRole
    model: str
    architecture: str
    bank_width: int
    device: str
    process: StageProcess
    config_digest: str
    op_records: int
    def __init__(self, role: _Optional[_Union[StageRole, str]] = ..., model: _Optional[str] = ..., architecture: _Optional[str] = ..., bank_width: _Optional[int] = ..., device: _Optional[str] = ..., process: _Optional[_Union[StageProcess, _Mapping]] = ..., config_digest: _Optional[str] = ..., op_records: _Optional[int] = ...) -> None: ...

class StageProcess(_message.Message):
    __slots__ = ("pid", "pid_namespace", "start_ticks")
    PID_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    START_TICKS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    pid_namespace: str
    start_ticks: int
    def __init__(self, pid: _Optional[int] = ..., pid_namespace: _Optional[str] = ..., start_ticks: _Optional[int] = ...) -> None: ...

class Fence(_message.Message):
    __slots__ = ("stage", "seq")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    stage: StageRole
    seq: int
    def __init__(self, stage: _Optional[_Union[StageRole, str]] = ..., seq: _Optional[int] = ...) -> None: ...

class KVUpdate(_message.Message):
    __slots__ = ("rid", "append", "reset")
    RID_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    rid: int
    append: _containers.RepeatedScalarFieldContainer[int]
    reset: bool
    def __init__(self, rid: _Optional[int] = ..., append: _Optional[_Iterable[int]] = ..., reset: _Optional[bool] = ...) -> None: ...

class PreludeBatch(_message.Message):
    __slots__ = ("rids", "token_ids", "positions", "rows", "init_seeds")
    RIDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    INIT_SEEDS_FIELD_NUMBER: _ClassVar[int]
    rids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    rows: _containers.RepeatedScalarFieldContainer[int]
    init_seeds: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., rows: _Optional[_Iterable[int]] = ..., init_seeds: _Optional[_Iterable[int]] = ...) -> None: ...

class LoopBatch(_message.Message):
    __slots__ = ("rids", "positions", "rows", "steps", "prefill", "num_steps", "copy_rids", "copy_positions", "copy_from_slots", "head", "columns")
    RIDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    COPY_RIDS_FIELD_NUMBER: _ClassVar[int]
    COPY_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    COPY_FROM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    rids: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    rows: _containers.RepeatedScalarFieldContainer[int]
    steps: _containers.RepeatedScalarFieldContainer[int]
    prefill: bool
    num_steps: int
    copy_rids: _containers.RepeatedScalarFieldContainer[int]
    copy_positions: _containers.RepeatedScalarFieldContainer[int]
    copy_from_slots: _containers.RepeatedScalarFieldContainer[int]
    head: HeadBatch
    columns: bytes
    def __init__(self, rids: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., rows: _Optional[_Iterable[int]] = ..., steps: _Optional[_Iterable[int]] = ..., prefill: _Optional[bool] = ..., num_steps: _Optional[int] = ..., copy_rids: _Optional[_Iterable[int]] = ..., copy_positions: _Optional[_Iterable[int]] = ..., copy_from_slots: _Optional[_Iterable[int]] = ..., head: _Optional[_Union[HeadBatch, _Mapping]] = ..., columns: _Optional[bytes] = ...) -> None: ...

class HeadBatch(_message.Message):
    __slots__ = ("rids", "positions", "rows", "sample", "token_index", "temperature", "top_k", "top_p", "seed", "logprobs", "return_logprob", "embed", "embed_ids", "score_ids", "processing", "history", "embed_rows", "masks", "columns")
    RIDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_INDEX_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    EMBED_FIELD_NUMBER: _ClassVar[int]
    EMBED_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORE_IDS_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    EMBED_ROWS_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    rids: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    rows: _containers.RepeatedScalarFieldContainer[int]
    sample: _containers.RepeatedScalarFieldContainer[bool]
    token_index: _containers.RepeatedScalarFieldContainer[int]
    temperature: _containers.RepeatedScalarFieldContainer[float]
    top_k: _containers.RepeatedScalarFieldContainer[int]
    top_p: _containers.RepeatedScalarFieldContainer[float]
    seed: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[int]
    return_logprob: _containers.RepeatedScalarFieldContainer[bool]
    embed: _containers.RepeatedScalarFieldContainer[bool]
    embed_ids: _containers.RepeatedScalarFieldContainer[int]
    score_ids: _containers.RepeatedScalarFieldContainer[int]
    processing: _containers.RepeatedCompositeFieldContainer[LogitsProcessing]
    history: _containers.RepeatedCompositeFieldContainer[HistorySeed]
    embed_rows: _containers.RepeatedScalarFieldContainer[int]
    masks: _containers.RepeatedScalarFieldContainer[bytes]
    columns: bytes
    def __init__(self, rids: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., rows: _Optional[_Iterable[int]] = ..., sample: _Optional[_Iterable[bool]] = ..., token_index: _Optional[_Iterable[int]] = ..., temperature: _Optional[_Iterable[float]] = ..., top_k: _Optional[_Iterable[int]] = ..., top_p: _Optional[_Iterable[float]] = ..., seed: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[int]] = ..., return_logprob: _Optional[_Iterable[bool]] = ..., embed: _Optional[_Iterable[bool]] = ..., embed_ids: _Optional[_Iterable[int]] = ..., score_ids: _Optional[_Iterable[int]] = ..., processing: _Optional[_Iterable[_Union[LogitsProcessing, _Mapping]]] = ..., history: _Optional[_Iterable[_Union[HistorySeed, _Mapping]]] = ..., embed_rows: _Optional[_Iterable[int]] = ..., masks: _Optional[_Iterable[bytes]] = ..., columns: _Optional[bytes] = ...) -> None: ...

class LogitsProcessing(_message.Message):
    __slots__ = ("index", "presence_penalty", "frequency_penalty", "repetition_penalty", "bias_ids", "bias_values", "min_tokens", "stop_ids")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    bias_ids: _containers.RepeatedScalarFieldContainer[int]
    bias_values: _containers.RepeatedScalarFieldContainer[float]
    min_tokens: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., bias_ids: _Optional[_Iterable[int]] = ..., bias_values: _Optional[_Iterable[float]] = ..., min_tokens: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class HistorySeed(_message.Message):
    __slots__ = ("index", "prompt_ids", "output_ids")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., output_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageBatch(_message.Message):
    __slots__ = ("seq", "fences", "kv_updates", "released", "prelude", "loop", "head", "ping", "traceparent", "trace_contexts", "fence_timeout_s")
    class TraceContextsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FENCES_FIELD_NUMBER: _ClassVar[int]
    KV_UPDATES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    PRELUDE_FIELD_NUMBER: _ClassVar[int]
    LOOP_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    FENCE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    seq: int
    fences: _containers.RepeatedCompositeFieldContainer[Fence]
    kv_updates: _containers.RepeatedCompositeFieldContainer[KVUpdate]
    released: _containers.RepeatedScalarFieldContainer[int]
    prelude: PreludeBatch
    loop: LoopBatch
    head: HeadBatch
    ping: Ping
    traceparent: str
    trace_contexts: _containers.ScalarMap[int, str]
    fence_timeout_s: float
    def __init__(self, seq: _Optional[int] = ..., fences: _Optional[_Iterable[_Union[Fence, _Mapping]]] = ..., kv_updates: _Optional[_Iterable[_Union[KVUpdate, _Mapping]]] = ..., released: _Optional[_Iterable[int]] = ..., prelude: _Optional[_Union[PreludeBatch, _Mapping]] = ..., loop: _Optional[_Union[LoopBatch, _Mapping]] = ..., head: _Optional[_Union[HeadBatch, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., traceparent: _Optional[str] = ..., trace_contexts: _Optional[_Mapping[int, str]] = ..., fence_timeout_s: _Optional[float] = ...) -> None: ...

class SampledLogprobs(_message.Message):
    __slots__ = ("present", "logprob", "top_ids", "top_logprobs")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    present: bool
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, present: _Optional[bool] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class StageReply(_message.Message):
    __slots__ = ("seq", "stage", "compute_s", "fence_wait_s", "signals", "lookahead", "token_ids", "logprobs", "error", "pong", "prompt_logprobs", "no_logprobs")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    FENCE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PONG_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NO_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stage: StageRole
    compute_s: float
    fence_wait_s: float
    signals: _containers.RepeatedScalarFieldContainer[float]
    lookahead: _containers.RepeatedScalarFieldContainer[float]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[SampledLogprobs]
    error: str
    pong: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[SampledLogprobs]
    no_logprobs: int
    def __init__(self, seq: _Optional[int] = ..., stage: _Optional[_Union[StageRole, str]] = ..., compute_s: _Optional[float] = ..., fence_wait_s: _Optional[float] = ..., signals: _Optional[_Iterable[float]] = ..., lookahead: _Optional[_Iterable[float]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[SampledLogprobs, _Mapping]]] = ..., error: _Optional[str] = ..., pong: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[SampledLogprobs, _Mapping]]] = ..., no_logprobs: _Optional[int] = ...) -> None: ...
