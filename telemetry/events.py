"""Typed telemetry events: the contract between the engine and the dashboard.

Every event becomes one row of the table named by its ``TABLE``. Every row
carries ``run_id`` (filled in by the writer), the scheduler ``tick`` and
``t_ns``, a monotonic time in nanoseconds since the run started. Field names
are column names; ``None`` means "not known / not applicable".

Plain Python only: no torch, no engine imports (a test enforces it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

SCHEMA_VERSION = 1

# Tick / chunk paths.
PATH_MIXED = "mixed"
PATH_PREFILL = "prefill"
PATH_DECODE = "decode"
PATH_IDLE = "idle"

# Chunk length rules (which rule set the planned length), see engine/scheduler/chunk_plan.py.
CAP_REMAINING = "remaining"            # the whole remainder fit under every cap
CAP_MAX_PREFILL = "max_prefill_tokens"
CAP_SLICE_BUDGET = "slice_budget"
CAP_WHOLE_PROMPT = "mla_whole_prompt"  # MLA model, mla_chunked_prefill off: never split (the reference)
CAP_SSM_TAIL = "ssm_tail_cut"
CAP_BLOCK_ALIGN = "block_align"
CAP_TAIL_SPLIT = "tail_split"
CAP_ENCODER_BUDGET = "encoder_budget"  # the next image's encoder run would pass the tick's encoder budget
CAP_IMAGE_WHOLE = "image_whole"        # image_whole on: the chunk stops before an image it would split

# Can-mix blockers (None when mixing was allowed).
BLOCK_BISECT = "bisect_no_mix"
BLOCK_NO_DECODES = "no_active_decodes"
BLOCK_EXPERT_PARALLEL = "expert_parallel"
BLOCK_SPECULATION = "speculation"

# Request statuses.
REQ_WAITING = "waiting"
REQ_PREFILLING = "prefilling"
REQ_DECODING = "decoding"
REQ_FINISHED = "finished"
REQ_ERROR = "error"
REQ_PREEMPTED = "preempted"
REQ_REJECTED = "rejected"
REQ_CANCELLED = "cancelled"         # ended by the client (HTTP disconnect) or by the engine's shutdown

# A request row is in flight until it reaches one of the end states.
IN_FLIGHT_STATUSES = (REQ_WAITING, REQ_PREFILLING, REQ_DECODING)
END_STATUSES = (REQ_FINISHED, REQ_ERROR, REQ_PREEMPTED, REQ_REJECTED, REQ_CANCELLED)
REQUEST_STATUSES = IN_FLIGHT_STATUSES + END_STATUSES
# The end states that count as failures (a summary's ``errors``). Cancelled is not one of them:
# the client or the shutdown ended the request, not the engine.
FAILURE_STATUSES = (REQ_ERROR, REQ_PREEMPTED, REQ_REJECTED)

# Chunk outcomes (``ChunkDecision.outcome``).
OUTCOME_OK = "ok"
OUTCOME_MIXED_KV_FALLBACK = "mixed_kv_fallback"   # the fused forward found no blocks: the chunk ran plain
OUTCOME_FAILED_KV = "failed_kv"                   # no blocks and nothing left to preempt: request ended
OUTCOME_FAILED_FORWARD = "failed_forward"         # the forward raised: request ended (decodes restored)
OUTCOME_FAILED_FIRST_TOKEN = "failed_first_token"  # the forward ran, sampling token 0 raised: request ended
CHUNK_OUTCOMES = (OUTCOME_OK, OUTCOME_MIXED_KV_FALLBACK, OUTCOME_FAILED_KV, OUTCOME_FAILED_FORWARD,
                  OUTCOME_FAILED_FIRST_TOKEN)
# Outcomes whose chunk tokens were computed (a tick's ``num_prefill_tokens`` counts them).
COMPUTED_OUTCOMES = (OUTCOME_OK, OUTCOME_MIXED_KV_FALLBACK, OUTCOME_FAILED_FIRST_TOKEN)

# ``GenericEvent.kind`` of a failed forward: one row per failure, naming the requests it ended.
EVENT_FORWARD_FAILED = "forward_failed"
# ``GenericEvent.kind`` of an InnerQ calibration state change (detail: old, new, tokens seen, scales).
EVENT_KV_QUANT_STATE = "kv_quant_state"
# KV cache quantization states a chunk row can carry (``ChunkDecision.kv_quant_state``):
# off = full precision (--kv-cache-dtype auto); InnerQ moves calibrating -> ready -> applied.
KV_QUANT_STATES = ("off", "calibrating", "ready", "applied")
# ``GenericEvent.kind`` of one expert-parallel rank's share of one forward (detail: rank, start_ns,
# broadcast_ns, expert_ns, exchange_ns, forward_ns); the Live timeline draws one lane per rank.
EVENT_EP_FORWARD = "ep_forward"
# ``GenericEvent.kind`` of a decode step compiled during a tick (detail: bucket, seconds, graphs, recompile,
# and the running totals num_graphs / num_recompiles): the recompile counter, never one per tick.
EVENT_DECODE_COMPILE = "decode_compile"
EVENT_ENCODER_RUN = "encoder_run"      # the vision tower ran for an image (detail: hash, tokens, duration_ns)
EVENT_ENCODER_HIT = "encoder_hit"      # an image's rows came from the encoder cache
# ``GenericEvent.kind`` of the reason a run ended ``failed`` (detail: reason), e.g. expert-parallel ranks
# that disagreed on their dtype at the start handshake, or a collective that failed mid-run.
EVENT_RUN_FAILED = "run_failed"
# ``GenericEvent.kind`` when no step is possible with work waiting (detail: blocker, num_waiting), and
# when work moves again (detail: the blocker that was): engine/serve/stall_watch.py. Ticks stop in
# between, so these two are the blocked time's only record (the Live timeline, the replay report).
EVENT_STALLED = "stalled"
EVENT_STALL_CLEARED = "stall_cleared"


@dataclass
class Event:
    """Base: every row has a tick and a run-relative monotonic time."""

    TABLE: ClassVar[str] = "events"
    tick: int
    t_ns: int

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class RunStarted:
    """One row in ``runs``; inserted when a run starts, updated on finish."""

    TABLE: ClassVar[str] = "runs"
    started_at: float                   # wall clock (unix seconds), for display only
    model: str                          # "tiny" or a checkpoint directory name
    device: str                         # "cpu", "cuda:0 (NVIDIA H200)", ...
    config: dict[str, Any]              # engine config (kv blocks, block size, slots, ...)
    model_config: dict[str, Any]        # the checkpoint's config.json (text part)
    versions: dict[str, str]            # python, torch, sqlite, ...
    workload: dict[str, Any]            # kind, rate, seed, scale factors, ...
    levers: dict[str, Any]              # lever values at start
    command_line: str = ""
    checkpoint_hash: str = ""
    status: str = "running"             # running / finished / crashed
    schema_version: int = SCHEMA_VERSION

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Tick(Event):
    TABLE: ClassVar[str] = "ticks"
    path: str = PATH_IDLE               # mixed / prefill / decode / idle
    duration_ns: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_active: int = 0                 # decoding sequences
    num_waiting: int = 0
    num_prefilling: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0            # usable blocks (after kv_blocks_cap)
    ssm_slots_used: int = 0
    ssm_slots_total: int = 0
    num_finished: int = 0               # requests that finished this tick
    kv_bytes_used: int | None = None    # bytes of KV blocks in use (quantized blocks at their size)
    kv_bytes_total: int | None = None   # the KV byte budget
    kv_tokens_used: int | None = None   # token slots of the blocks in use (blocks x block size)
    kv_tokens_total: int | None = None  # token slots in use + what the free bytes hold as new blocks
    # The least time this machine could take for the tick's forwards (max of FLOPs at the GEMM
    # rate and bytes at the read bandwidth, engine/model/roofline.py); roofline_ns / duration_ns
    # is the share of the machine the tick reached. None when the engine measured no rates.
    roofline_ns: int | None = None
    num_constrained_rows: int = 0       # sampled rows a grammar mask constrained this tick
    grammar_mask_ns: int = 0            # time spent filling and applying grammar masks this tick


@dataclass
class ChunkDecision(Event):
    TABLE: ClassVar[str] = "chunks"
    request_id: int = 0
    offset: int = 0
    length: int = 0                     # final planned length
    prompt_len: int = 0
    is_last: bool = False
    cap_rule: str = CAP_REMAINING       # the rule that set the length
    max_prefill_tokens: int = 0
    slice_budget: int | None = None     # None unless always_mixed
    ssm_tail_boundary: int | None = None
    path: str = PATH_PREFILL            # mixed / prefill
    can_mix: bool = False
    mix_blocker: str | None = None      # one of BLOCK_* or None
    decode_width: int = 0
    duration_ns: int = 0
    outcome: str = OUTCOME_OK           # one of CHUNK_OUTCOMES
    num_preempted: int = 0              # victims this chunk needed
    kv_quant_state: str | None = None   # one of KV_QUANT_STATES: what the poll before this chunk left
    ep_broadcast_ns: int | None = None  # under expert parallelism: rank 0's broadcast before the forward
    first_token_rules: str | None = None  # last chunk: the first-token rules that fired, comma-separated
    slice_budget_ignored: bool = False  # the MLA whole-prompt rule ran past the slice budget in force
    image_spans: str | None = None      # image placeholder rows the chunk covered: "image#first-end", space-separated
    encoder_ns: int | None = None       # the vision tower's time inside this chunk's forward
    ep_vision_sync_ns: int | None = None  # under expert parallelism: rank 0's broadcast of the image rows


@dataclass
class StreamEvent(Event):
    TABLE: ClassVar[str] = "stream_events"
    kind: str = "record"                # record / wait / sync
    stream: str = "default"             # default / prefill / secondary
    event_name: str = ""
    seq: int = 0                        # links a wait to the record it waits for
    target_stream: str | None = None    # the stream made to wait (for "wait")
    gpu_elapsed_ms: float | None = None


@dataclass
class Preemption(Event):
    TABLE: ClassVar[str] = "preemptions"
    victim_request_id: int = 0
    blocks_freed: int = 0
    reason: str = ""
    policy: str = "most_blocks"
    prefill_request_id: int | None = None
    num_remaining: int = 0
    num_grammar_skipped: int = 0        # grammar holders passed over (never victims)


@dataclass
class RequestRecord(Event):
    """Upserted by (run_id, request_id): inserted on arrival, replaced as it moves."""

    TABLE: ClassVar[str] = "requests"
    request_id: int = 0
    status: str = REQ_WAITING
    arrival_ns: int | None = None
    admitted_ns: int | None = None
    first_token_ns: int | None = None
    finished_ns: int | None = None
    arrival_tick: int | None = None
    prompt_len: int = 0
    output_len: int = 0
    prefix_hit_tokens: int = 0
    prefix_miss_reason: str | None = None
    error: str | None = None
    finish_reason: str | None = None    # eos / stop / length / error / cancelled
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_k, top_p, min_p, seed, ...
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    conversation_id: int | None = None
    source: str | None = None           # api / workload / replay (a recorded workload served again)
    features: dict[str, Any] = field(default_factory=dict)  # thinking, tool call, stop strings, logprobs
    first_token_rules: str | None = None  # the first-token rules that fired, comma-separated
    grammar: dict[str, Any] | None = None   # {"kind", "value"[, "after_think"]}: what the output obeys
    grammar_kind: str | None = None         # json_object / json_schema / regex / choice / lark
    grammar_ready_tick: int | None = None   # tick its compile was seen done (a replay waits for it)
    grammar_valid: bool | None = None       # the ended output is a complete sentence of its grammar
    grammar_approximations: str | None = None   # schema keywords a lenient compile ignored, comma-separated
    num_images: int = 0                     # images in the prompt (engine/multimodal/)


@dataclass
class RequestEvent(Event):
    """One lifecycle step (arrived / admitted / prefill_start / first_token, then the end: finished /
    error / preempted / rejected / cancelled)."""

    TABLE: ClassVar[str] = "request_events"
    request_id: int = 0
    kind: str = "arrived"
    detail: str | None = None


@dataclass
class TokenEvent(Event):
    """One generated token: ITL percentiles come from consecutive rows of a request."""

    TABLE: ClassVar[str] = "tokens"
    request_id: int = 0
    index: int = 0                      # position in the output
    token_id: int = 0


@dataclass
class LeverChange(Event):
    TABLE: ClassVar[str] = "lever_changes"
    name: str = ""
    old: Any = None
    new: Any = None
    source: str = "file"                # default / env / file / dashboard / replay
    status: str = "applied"             # applied / rejected
    reason: str | None = None
    file_version: int | None = None


@dataclass
class GenericEvent(Event):
    """Rarer things: drafts dropped, SSM normalization acted or failed, telemetry trouble."""

    TABLE: ClassVar[str] = "events"
    kind: str = ""
    request_id: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


EVENT_TYPES: tuple[type, ...] = (
    Tick, ChunkDecision, StreamEvent, Preemption, RequestRecord,
    RequestEvent, TokenEvent, LeverChange, GenericEvent,
)
TABLES: tuple[str, ...] = ("runs",) + tuple(t.TABLE for t in EVENT_TYPES)
