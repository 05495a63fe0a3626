"""What crosses between the engine process and the API frontend process, and how it is framed.

One Unix socket pair joins them. Each message is a length-prefixed pickle (both ends are this
code, started by the engine; nothing from a client is unpickled). The frontend sends a list of
``Submit`` / ``Cancel`` / ``MetricsQuery`` per event-loop turn; the engine sends one ``Batch``
per tick boundary (and one as each first token is sampled): every stream's new tokens and ends,
the queue snapshot for 429, and the answers to /metrics queries; right after a drain, the
request id each new submission got (the API returns it: header and the response id's suffix). Pure Python: no torch here.
"""
from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass, field
from typing import Any

from engine.scheduler.request_features import RequestFeatures

HEADER = struct.Struct("<I")          # the pickle's length in bytes
MAX_MESSAGE_BYTES = 256 << 20         # far above any real batch: a larger length is a broken peer


class PeerGone(Exception):
    """The other process closed its end (it exited or was killed)."""


@dataclass(frozen=True)
class FrontendConfig:
    """The engine's first message: what the frontend needs to parse, validate and serve requests."""

    model_name: str
    checkpoint_dir: str          # tokenizer.json and the chat template are read from here
    vocab_size: int
    max_context: int
    num_kv_blocks: int
    block_size: int
    eos_ids: frozenset[int]
    tool_call_start_id: int | None
    tool_call_end_id: int | None
    think_end_id: int | None
    eos_token_id: int | None     # the model's own EOS (the grammar compiler's)
    host: str
    port: int
    api_key: str | None
    max_waiting: int
    images: Any = None           # engine.multimodal.limits.ImagePolicy for a checkpoint with a vision tower


@dataclass(frozen=True)
class Ready:
    """Frontend -> engine once uvicorn listens (``port`` is the bound one: ``--api-port 0`` picks any)."""

    port: int
    chat_template: str           # where the chat template came from (logged by the engine)


@dataclass(frozen=True)
class Failed:
    """Frontend -> engine when it cannot start (then it exits)."""

    message: str


@dataclass(frozen=True)
class Tokens:
    """New output tokens (and their logprobs when asked for); the first batch of a request that
    asked for its prompt's logprobs carries them (prompt token 1 on: nothing predicts token 0)."""

    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]]
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass(frozen=True)
class Ended:
    status: str                  # finished / error / cancelled / rejected / preempted
    finish_reason: str | None    # eos / stop / length / error / cancelled
    error: str | None
    prompt_len: int
    output_len: int
    first_token_rules: str | None


@dataclass(frozen=True)
class Submit:
    handle: int                  # the frontend's id for the request (the engine gives the request id)
    prompt_tokens: list[int]
    sampling: dict
    features: RequestFeatures
    grammar: dict | None = None
    images: tuple[bytes, ...] = ()   # the bytes ``features.images`` names (the engine's image store keeps them)


@dataclass(frozen=True)
class Cancel:
    handle: int


@dataclass(frozen=True)
class MetricsQuery:
    query_id: int


@dataclass
class Batch:
    """Engine -> frontend at a tick boundary (or mid-tick with first tokens only).

    Plain tuples rather than ``Tokens`` / ``Ended`` objects: pickling 64 streams' tuples costs
    the tick loop ~25 us, the same as dataclasses ~140 us. The frontend builds the objects."""

    tokens: list[tuple[int, list[int], list]] = field(default_factory=list)   # (handle, ids, logprobs), first tokens first
    ended: list[tuple] = field(default_factory=list)    # (handle, *Ended's fields), after every stream's tokens
    num_waiting: int = 0          # the scheduler's waiting queue now
    num_drained: int = 0          # submissions the engine has taken so far (the rest are in flight)
    metrics: dict[int, list[Any]] = field(default_factory=dict)             # query id -> metric families
    prompt_logprobs: dict[int, list] = field(default_factory=dict)         # handle -> its prompt's, with its first tokens
    request_ids: dict[int, int] = field(default_factory=dict)            # handle -> the engine's request id, once drained


def frame(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(payload)) + payload


def unframe(buffer: bytearray) -> list[Any]:
    """Every whole message at the start of ``buffer`` (removed from it); a partial one stays."""
    out, at = [], 0
    while len(buffer) - at >= HEADER.size:
        (size,) = HEADER.unpack_from(buffer, at)
        if size > MAX_MESSAGE_BYTES:
            raise PeerGone(f"a message of {size} bytes: the peer is broken")
        if len(buffer) - at - HEADER.size < size:
            break
        out.append(pickle.loads(bytes(buffer[at + HEADER.size:at + HEADER.size + size])))
        at += HEADER.size + size
    del buffer[:at]
    return out
