"""A deployment's configuration, read in this one place: the services' operational knobs (``Settings``) and the
engine options (``cdb_engine.config.EngineConfig``), one typed source (``cdb_engine.config_source``, on
pydantic-settings). Each value comes from, highest first: the process's command-line flag (``cdb serve``,
``cdb scheduler``, ``cdb stage``, ``cdb demo``), the ``CDB_*`` environment variable, the config file named by
``--config FILE`` or ``CDB_CONFIG`` (TOML, or YAML for ``.yaml``/``.yml``; its keys are the variables' names
without ``CDB_``, in lower case: ``max_num_seqs = 16``), the field's default (the tables below). ``auto`` (the
model's own value) is allowed where the default says so. The tables are the fields' own help
(``metadata["help"]``): ``python -m services.settings`` prints them and a test holds this docstring equal to it.

A process resolves its configuration once, into ``Resolved`` (frozen: ``Settings`` + ``EngineConfig``). The
launcher hands its children that one record as a JSON document (``--resolved-config FILE``), which they read
instead of the environment and the config file: every process of a tree runs with the same values, and ``Info``
shows them (``config_json``) with their digest and each stage's digest.

The package: ``knobs`` (``Settings``, the fields by concern), ``checks`` (each value's validation and the parsers of
the list-valued ones), ``source`` (reading the source once: ``load_configuration``, ``load_settings``, the
launcher's document), ``resolved`` (``Resolved``, the record a tree hands its children), ``table`` (these tables).

| variable | default | meaning |
|---|---|---|
| ``CDB_CONFIG`` | (unset) | config file (TOML; YAML: .yaml/.yml) of any keys below; ``--config`` overrides it |
| ``CDB_STAGE_THREADS`` | 1 | torch intra-op threads per stage process (three stages share the host's cores) |
| ``CDB_FENCE_TIMEOUT_S`` | 600 | a stage fails a batch whose fences stay unmet this long (or the batch's own limit) |
| ``CDB_FENCE_SPIN_S`` | auto | spin on a fence or for the next op before sleeping; auto: 2e-4 s on 8+ cores, else 0 |
| ``CDB_STAGE_CONNECT_TIMEOUT_S`` | 120 | how long the scheduler waits for its stages to be ready at start |
| ``CDB_STAGE_KEEPALIVE_S`` | 5 | HTTP/2 keepalive ping interval on stage channels (a frozen stage is detected) |
| ``CDB_STAGE_PROBE_TIMEOUT_S`` | 2 | deadline of the health probe of each stage |
| ``CDB_HEALTH_INTERVAL_S`` | 0.5 | period of the scheduler's readiness check |
| ``CDB_STALL_TIMEOUT_S`` | 15 | work pending without engine progress this long: NOT_SERVING |
| ``CDB_DRAIN_TIMEOUT_S`` | 30 | SIGTERM: how long in-flight streams may finish before they are cancelled |
| ``CDB_MAX_CONCURRENT_RPCS`` | 1024 | hard cap of concurrent gRPC calls but health checks (RESOURCE_EXHAUSTED beyond) |
| ``CDB_READY_TIMEOUT_S`` | 180 | ``serve_all``: how long to wait for every child to become ready |
| ``CDB_UVLOOP`` | true | run the public server's event loop on uvloop when installed |
| ``CDB_METRICS_ADDR`` | (unset) | ``HOST:PORT`` of the scheduler's Prometheus endpoint (``:9464``: all interfaces) |
| ``CDB_CPUS`` | (unset) | pin the processes to CPUs, e.g. ``loop:1,head:0,prelude:0,scheduler:0`` (``+``: several) |
| ``CDB_STAGE_SECRET`` | (unset) | the stage plane's shared secret (prefer ``CDB_STAGE_SECRET_FILE``) |
| ``CDB_STAGE_SECRET_FILE`` | (unset) | file (mode 0600) holding the stage plane's secret; ``cdb serve`` makes one |
| ``CDB_LINK_SECRET_FILE`` | (unset) | front ends: 0600 file of the link's secret, in place of the stage one's |
| ``CDB_LINK_TIMEOUT_S`` | 5 | a scheduler silent (a front end not reading) this long: its link is lost, 503s |
| ``CDB_STAGE_DOWN_LIMIT_S`` | 60 | a stage missing this long: requests fail ``UNAVAILABLE``, the scheduler exits 1 |
| ``CDB_RECONNECT_BACKOFF_S`` | 0.05 | first delay between reconnect attempts to a lost stage (doubles up to 0.5 s) |
| ``CDB_STAGE_HANG_FLOOR_S`` | 30 | no stage op is judged hung before it has run this long |
| ``CDB_STAGE_HANG_FACTOR`` | 20 | an op past this many times its expected time (pace x tokens): its stage is replaced |
| ``CDB_FRONTENDS`` | auto | front-end processes (0: the scheduler serves the ports); auto: by the cores and device |
| ``CDB_STANDBY_STAGES`` | false | a warm standby process per stage role: a lost stage is replaced at once (2x memory) |
| ``CDB_STAGE_FORK`` | true | stages are forked from one process that imported torch (fast starts, restarts; Linux) |
| ``CDB_STAGE_RINGS`` | true | stage ops and replies travel on shared-memory rings (x86-64 Linux); false: on gRPC |
| ``CDB_STAGE_RING_BYTES`` | 4194304 | capacity of each stage ring (two per stage); the largest op or reply fits |
| ``CDB_CUDA_GRAPHS`` | true | on CUDA, decode loop ops replay graphs captured per width and context bucket |
| ``CDB_TLS_CERT`` | (unset) | PEM certificate chain of the public port (with ``CDB_TLS_KEY``: TLS on) |
| ``CDB_TLS_KEY`` | (unset) | PEM private key of the public port |
| ``CDB_TLS_CLIENT_CA`` | (unset) | PEM CA bundle: the public port requires client certificates signed by it (mTLS) |
| ``CDB_API_KEYS`` | (unset) | comma-separated API keys accepted as ``authorization: Bearer KEY`` on the public port |
| ``CDB_API_KEYS_FILE`` | (unset) | file with one API key per line (``#`` comments), merged with ``CDB_API_KEYS`` |
| ``CDB_MAX_STREAMS_PER_CONNECTION`` | 256 | HTTP/2 max concurrent streams per client connection of the public port |
| ``CDB_KEEPALIVE_MIN_TIME_S`` | 10 | clients may ping no more often than this (more often: GOAWAY) |
| ``CDB_MAX_REQUESTS_PER_CALLER`` | auto | one caller's live requests (by API key, else host); auto: half the capacity |
| ``CDB_MAX_STREAMS_PER_CALLER`` | auto | open streams of one caller (gRPC, SSE); auto: as max_requests_per_caller |
| ``CDB_MAX_HEALTH_WATCHES`` | 256 | open health Watch streams of all callers (apart from the RPC cap) |
| ``CDB_STREAM_STALL_TIMEOUT_S`` | 60 | a stream whose client takes no message this long is cut, its request aborted |
| ``CDB_IDLE_CONNECTION_TIMEOUT_S`` | 300 | gRPC: a connection without calls this long is closed (GOAWAY) |
| ``CDB_HTTP_KEEP_ALIVE_S`` | 5 | HTTP: an idle keep-alive connection is closed after this long |
| ``CDB_HTTP_MAX_CONNECTIONS`` | 2048 | HTTP: open connections and requests past this get 503 at once |
| ``CDB_HTTP_MAX_CONNECTIONS_PER_PEER`` | 256 | HTTP: a client host's connections past this get 429 (proxies: none) |
| ``CDB_FORWARDED_ALLOW_IPS`` | (unset) | HTTP: proxies (IPs, CIDRs; * any) whose X-Forwarded-For names the client |
| ``CDB_HEADER_READ_TIMEOUT_S`` | 10 | time for a new connection's handshake (gRPC), for a request's headers (HTTP) |
| ``CDB_BODY_READ_TIMEOUT_S`` | 30 | HTTP: time for a request's whole body once its headers are in (else 408) |
| ``CDB_HTTP_ADDR`` | (unset) | ``HOST:PORT`` of the OpenAI HTTP API (``cdb serve``: 127.0.0.1:8000); empty: none |
| ``CDB_SERVED_MODEL_NAME`` | (unset) | model names the HTTP API accepts, comma-separated; the first is reported |
| ``CDB_CHAT_TEMPLATE`` | (unset) | HTTP API chat template: a Jinja file or the template; empty: the tokenizer's |
| ``CDB_MAX_REQUEST_BYTES`` | 4194304 | largest HTTP request body; more: 413 before parsing and the API-key check |
| ``CDB_STAGE_OP_LOG`` | (unset) | folder where each stage writes its per-op timeline (``cdb bench hostpath``) |
| ``CDB_RESTART_LIMIT`` | 5 | a child exiting this many times in a row without serving stops the tree (exit 1) |
| ``CDB_RESTART_BACKOFF_S`` | 0.5 | delay of a child's 2nd restart in a row (the 1st is at once); doubles per restart |
| ``CDB_RESTART_BACKOFF_MAX_S`` | 30 | longest delay between two restarts of a failing child |
| ``CDB_LOG_LEVEL`` | info | log level of every process of the tree: debug, info, warning or error |
| ``CDB_LOG_DIR`` | (unset) | folder where each process of a tree writes NAME.log, kept; empty: a temporary one |
| ``CDB_LOG_FORMAT`` | text | log lines as text, or json: one JSON object per line |
| ``CDB_REQUEST_LOG`` | false | log a line per finished request: id, caller, tokens, depth, reason, latency |
| ``CDB_THROUGHPUT_LOG_INTERVAL_S`` | 10 | period of the scheduler's throughput log line; 0: none |
| ``CDB_METRICS_VLLM_NAMES`` | false | also export the main series under vLLM's names (vllm:num_requests_waiting..) |
| ``CDB_METRICS_CACHE_S`` | 0.1 | a metrics scrape this soon after the last gets its body again (gateways scrape 20/s) |
| ``CDB_REQUEST_LATENCY_BUCKETS`` | (unset) | bucket bounds (s) of TTFT, end-to-end, queue time; empty: 1 ms..2 h |
| ``CDB_TOKEN_LATENCY_BUCKETS`` | (unset) | bucket bounds (s) of inter-token latency and TPOT; empty: 1 ms..60 s |

The engine options, the same for the four processes of a tree (each also ``--option`` of ``cdb serve``, ``cdb
scheduler`` and ``cdb demo``; ``cdb stage`` takes ``--model``, ``--dtype`` and ``--device``):

| variable | default | meaning |
|---|---|---|
| ``CDB_MODEL`` | ouro-tiny | a preset name (cdb presets) or a local checkpoint folder |
| ``CDB_TOKENIZER`` | (unset) | a tokenizer folder (or tokenizer.json) instead of the model's; empty: the model's |
| ``CDB_DTYPE`` | auto | compute dtype; auto: bfloat16 on CUDA, float32 elsewhere |
| ``CDB_DEVICE`` | auto | compute device of every process: cpu, cuda or cuda:N; auto: cuda when present |
| ``CDB_MODE`` | cdb | cdb: refill freed loop slots at once; no-refill: lockstep waves; full-depth: no early exit |
| ``CDB_MAX_NUM_SEQS`` | 32 | resident requests = the width of the loop batch |
| ``CDB_NUM_KV_BLOCKS`` | auto | KV-cache blocks per pool; auto: sized to memory (cdb_engine.memory) |
| ``CDB_GPU_MEMORY_UTILIZATION`` | 0.9 | share of the GPU's memory (CPU: of the RAM free at start) the server may use |
| ``CDB_KV_CACHE_MEMORY`` | auto | bytes of KV cache per device, over gpu_memory_utilization; auto: unset |
| ``CDB_KV_BLOCK_SIZE`` | 16 | tokens per KV-cache block |
| ``CDB_KV_POLICY`` | last_exited | which loop-KV depth slot a token writes and reads (depth_indexed: as trained) |
| ``CDB_KV_SHARED_AFTER`` | 2 | first_then_shared: private KV slots for the first k-1 loop steps, then one shared |
| ``CDB_MAX_DEPTH`` | auto | loop steps per token at most; auto: the model's |
| ``CDB_EXIT_RULE`` | auto | what ends a token's loop; auto: the family's own (Ouro hazard, Huginn latent-diff) |
| ``CDB_EXIT_THRESHOLD`` | auto | Ouro gate CDF q in (0, 1], Huginn latent diff >= 0; auto: the model's or 0.5 / 0.1 |
| ``CDB_EARLY_EXIT`` | true | false (--no-early-exit): the server's default threshold serves every token at full depth |
| ``CDB_MIN_DEPTH`` | 1 | loop steps every token runs before it may exit |
| ``CDB_FIXED_DEPTH`` | auto | exit rule fixed: every token at this depth; auto: the max depth |
| ``CDB_HORIZON`` | one-ahead | one-ahead: exit decisions one loop step ahead; same-step: upstream's rule |
| ``CDB_PREFILL_TOKEN_BUDGET`` | 2048 | prompt tokens prefilled per scheduling step |
| ``CDB_PREFILL_CHUNK_SIZE`` | 256 | prompt tokens per prefill chunk (a prefix cache hit ends on a multiple of it) |
| ``CDB_MIN_HEAD_BATCH_SIZE`` | auto | exited tokens the head waits for; auto: 1 for Ouro, max_num_seqs/4 for Huginn |
| ``CDB_MAX_HEAD_WAIT_STEPS`` | 4 | an exited token waits at most this many loop ops for a head batch of that size |
| ``CDB_LOOP_PIPELINE_DEPTH`` | 2 | loop ops in flight at once |
| ``CDB_MAX_INPUT_TOKENS`` | auto | longest prompt accepted; auto: the model's max positions - 1 |
| ``CDB_MAX_TOTAL_TOKENS`` | auto | prompt + max_tokens at most; auto: the model's max positions |
| ``CDB_MAX_WAITING`` | 256 | bounded waiting queue: beyond it, requests get RESOURCE_EXHAUSTED |
| ``CDB_INIT_SEED`` | -1 | Huginn initial state: < 0 zero, else a seeded truncated normal per position |
| ``CDB_NUM_THREADS`` | auto | torch intra-op threads of the in-process executor; auto: torch's default |
| ``CDB_FUSE_REFILL_EMBED`` | true | Ouro: the head op embeds a refill's input token (no prelude op per step) |
| ``CDB_FUSE_LOOP_HEAD`` | true | Ouro: loop ops sample the exited tokens and run their successors (no head op) |
| ``CDB_ENABLE_PREFIX_CACHING`` | true | reuse the KV of cached prompt prefixes (at chunk boundaries: exact) |
| ``CDB_PRIORITY_DEPTH`` | auto | while requests wait, less urgent priorities exit at this threshold; auto: off |
| ``CDB_FORCED_SKIP`` | true | structured output: forced tokens are not sampled, and their positions exit at min depth |
| ``CDB_SPECULATIVE`` | auto | self-speculative decoding: auto (where drafts pay at the measured op cost), on, off |
| ``CDB_SPECULATIVE_TOKENS`` | 4 | tokens of one request running ahead of its oldest unverified one, at most |
| ``CDB_SPECULATIVE_MAX_OCCUPANCY`` | auto | draft below this share of max_num_seqs; auto: all (on: 0.5 GPU, 0.25 CPU) |
| ``CDB_SPECULATIVE_DEPTH`` | auto | loop steps a token runs before its successor is drafted; auto: 1, adaptive |
| ``CDB_ALLOW_REPLAY_DEPTHS`` | false | accept per-request replayed depths (benchmarks; implied by exit rule replay) |
| ``CDB_SYNTHETIC_COST`` | (unset) | synthetic stages, modelled device time: loop=A:B:C,head=.. (µs) or h200:ouro-1.4b |
| ``CDB_SYNTHETIC_DEPTHS`` | (unset) | synthetic exit depths MEAN:MIN[:ACCEPT]; empty: 2.5:2 Ouro, 6:3 Huginn |
"""

# What the services import from the package itself
from services.settings.checks import SettingsError as SettingsError
from services.settings.checks import served_names as served_names
from services.settings.knobs import Settings as Settings
from services.settings.resolved import Resolved as Resolved
from services.settings.source import load_settings as load_settings
