"""Levers: runtime switches of the scheduler, their registry and the levers file.

Sources in increasing priority: defaults, environment (``CHUNKSCOPE_<NAME>``),
the levers file. The file is JSON ``{"version": N, "levers": {name: value}}``
written atomically (tmp in the same directory + fsync + ``os.replace`` + dir
fsync) so a watcher never sees half a file. Every value is validated strictly;
a bad file is rejected as a whole with one clear line and the previous values
stay in force.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping

from telemetry.lever_spec import Lever, LeversError

MAX_FILE_BYTES = 64 * 1024

SPECULATION_CHOICES = ("off", "ngram", "mtp", "self")
PREEMPT_POLICIES = ("most_blocks", "newest", "fewest_output")


LEVERS: tuple[Lever, ...] = (
    Lever("bisect_no_mix", bool, False,
          "Never fuse a prefill chunk with the decode batch: every chunk runs as a plain prefill "
          "and decodes wait for the next tick. A bisection switch for mixed-forward bugs. "
          "Watch: path mix goes to 0% mixed, chunks show blocker bisect_no_mix, ITL p99 rises."),
    Lever("ssm_tail_ckpt", bool, False,
          "Snapshot the SSM (linear-attention) state at the prompt's last full KV block so a "
          "later request sharing the prefix can reuse it; without mid-chunk capture the chunk "
          "is cut at that boundary. Watch: chunks with cap ssm_tail_cut, prefix hit ratio."),
    Lever("ssm_tail_midchunk", bool, False,
          "With ssm_tail_ckpt: capture the SSM snapshot inside the chunk instead of cutting the "
          "chunk at the tail boundary (fewer, longer chunks). Watch: ssm_tail_cut caps disappear, "
          "chunk count per prompt drops."),
    Lever("always_mixed", bool, False,
          "Cap every prefill chunk at slice_budget so prefill always rides along with decodes in "
          "small slices (smoother ITL, slower TTFT). Watch: chunks capped by slice_budget, "
          "ITL p99 vs TTFT p50."),
    Lever("slice_budget", int, 64,
          "Chunk cap in tokens used when always_mixed is on. Smaller = smoother decode, more "
          "ticks per prompt. Watch: chunk lengths, ticks per request, TTFT.",
          bounds=(1, 65536)),
    Lever("max_prefill_tokens", int, 256,
          "Largest prefill chunk in tokens per tick (sized for the tiny engine). Larger = fewer "
          "chunks and faster TTFT but longer ticks that stall decodes. Watch: chunk length "
          "histogram, tick duration, ITL p99.",
          bounds=(1, 1 << 20)),
    Lever("speculation", str, "off",
          "Speculative decoding kind: off, ngram (prompt-lookup drafts), mtp (the checkpoint's "
          "multi-token-prediction module; tiny has one, a checkpoint without mtp.* tensors is "
          "refused with the reason logged), self (early exit after self_draft_layers layers); "
          "drafts are verified in one forward with exact acceptance. A speculative step runs at "
          "decode width 1 and blocks mixing there. Watch: acceptance by kind, drafted / accepted "
          "per tick, blocker speculation in chunks, drafts dropped, tokens/s.",
          choices=SPECULATION_CHOICES),
    Lever("num_speculative_tokens", int, 2,
          "Drafts per speculative step (k): the verify forward covers k + 1 rows and a step emits "
          "1..k+1 tokens. More pays only while acceptance stays high. Watch: acceptance rate, "
          "tokens per verify step, tokens/s.",
          bounds=(1, 8)),
    Lever("ngram_min_match", int, 1,
          "Shortest suffix (in tokens) the ngram drafter matches: prompt lookup tries the last 3 "
          "tokens, then 2, down to this. 1 drafts after any one-token match; on a byte-level "
          "model (tiny, tiny-chat) such matches are mostly noise and 3 keeps only the drafts "
          "likely to be accepted (./run.sh sets 3). Watch: ngram acceptance, tokens per step.",
          bounds=(1, 3)),
    Lever("self_draft_layers", int, 0,
          "Layers the self-speculative draft runs before its early exit (then the final norm and "
          "LM head); 0 = half the model's layers (tiny: 2 of 4). Clamped to the layers minus one. "
          "Watch: acceptance with self, tokens/s.",
          bounds=(0, 1024)),
    Lever("no_mtp_minp", bool, False,
          "Disable min-p filtering when sampling under MTP speculation (min_p treated as 0) so "
          "draft acceptance is not cut by min-p. Watch: acceptance / tokens/s with mtp.",
          ),
    Lever("adaptive_sampling", bool, False,
          "Sample greedily while a sequence is inside a code fence or a tool call (structured "
          "output breaks on one unlucky token); the request's own sampling elsewhere. Watch: "
          "outputs of sampled requests inside fences match their greedy continuation.",
          ),
    Lever("preempt_policy", str, "most_blocks",
          "Which running request is preempted when the KV cache runs out: most_blocks (the "
          "reference scheduler's choice: frees most memory), newest (least work lost), "
          "fewest_output (least generated text lost). Watch: preemptions table, e2e p99.",
          choices=PREEMPT_POLICIES),
    Lever("kv_blocks_cap", int, 0,
          "Runtime cap on usable KV blocks (0 = no cap): shrink the cache live to provoke "
          "preemption. Watch: KV use chart hits the cap line, preemptions appear.",
          bounds=(0, 1 << 24)),
    Lever("mla_chunked_prefill", bool, False,
          "MLA models (Kimi Linear): off is the reference's rule, a prompt's chunk is its whole "
          "remainder (its MLA prefill attends only over the current call's K/V) and the slice "
          "budget is ignored, so decodes wait behind a whole long prefill; on, a chunk attends over "
          "the request's cached latents (gathered in bounded sub-chunks, merged by log-sum-exp) and "
          "MLA prompts chunk and mix like any other. No effect on other models. Watch: chunks with "
          "cap mla_whole_prompt vs max_prefill_tokens, ITL p99 and TTFT during long prompts."),
    Lever("max_tick_tokens", int, 4096,
          "The tick's token budget: the most prompt tokens one forward may compute. It binds under "
          "the MLA whole-prompt rule (mla_chunked_prefill off), whose chunk ignores max_prefill_tokens: "
          "a longer prompt can never start and is rejected with the reason instead of stalling the "
          "queue. Watch: rejected requests naming max_tick_tokens.",
          bounds=(1, 1 << 20)),
    Lever("encoder_budget", int, 0,
          "Vision checkpoints: the most image embedding rows the vision tower may newly encode per tick "
          "(0: no limit). A chunk that would first cover an image past the budget stops before it (the "
          "image at the chunk's start always runs, so prompts progress); cached images cost nothing. "
          "Watch: chunks with cap encoder_budget, encoder_ns on chunk rows, TTFT of image prompts.",
          bounds=(0, 1 << 20)),
    Lever("image_whole", bool, False,
          "Vision checkpoints: never end a chunk inside an image's placeholder tokens; the chunk stops "
          "before the image instead (an image longer than the chunk cap is still split). Off, chunks "
          "split images and take their rows' slice of the cached embeddings. Watch: chunks with cap "
          "image_whole, image spans on chunk rows."),
)
LEVERS_BY_NAME: dict[str, Lever] = {lever.name: lever for lever in LEVERS}


@dataclass(frozen=True)
class LeverValues:
    """One typed, immutable set of lever values (field per registered lever)."""

    bisect_no_mix: bool = False
    ssm_tail_ckpt: bool = False
    ssm_tail_midchunk: bool = False
    always_mixed: bool = False
    slice_budget: int = 64
    max_prefill_tokens: int = 256
    speculation: str = "off"
    num_speculative_tokens: int = 2
    ngram_min_match: int = 1
    self_draft_layers: int = 0
    no_mtp_minp: bool = False
    adaptive_sampling: bool = False
    preempt_policy: str = "most_blocks"
    kv_blocks_cap: int = 0
    mla_chunked_prefill: bool = False
    max_tick_tokens: int = 4096
    encoder_budget: int = 0
    image_whole: bool = False

    def __post_init__(self) -> None:
        for name, value in self.as_dict().items():
            LEVERS_BY_NAME[name].check(value)

    def replace(self, **changes: Any) -> "LeverValues":
        """A copy with ``changes`` applied; unknown names or bad values raise LeversError."""
        for name in changes:
            if name not in LEVERS_BY_NAME:
                raise LeversError(f"unknown lever {name!r} (known: {', '.join(LEVERS_BY_NAME)})")
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def changes_from(self, previous: "LeverValues") -> dict[str, tuple[Any, Any]]:
        """name -> (old, new) for every lever that differs from ``previous``."""
        old, new = previous.as_dict(), self.as_dict()
        return {name: (old[name], new[name]) for name in new if old[name] != new[name]}


def defaults() -> LeverValues:
    return LeverValues(**{lever.name: lever.default for lever in LEVERS})


def from_env(environ: Mapping[str, str] | None = None, base: LeverValues | None = None) -> LeverValues:
    """Defaults (or ``base``) overridden by ``CHUNKSCOPE_<NAME>`` variables; a bad one raises LeversError."""
    environ = os.environ if environ is None else environ
    changes = {}
    for lever in LEVERS:
        if lever.env_var in environ:
            try:
                changes[lever.name] = lever.parse_text(environ[lever.env_var])
            except LeversError as exc:
                raise LeversError(f"environment {lever.env_var}: {exc}") from None
    return (base or defaults()).replace(**changes)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise LeversError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _reject_constant(name: str) -> None:
    raise LeversError(f"{name} is not a valid JSON number")


def validate_file_bytes(raw: bytes) -> tuple[int, dict[str, Any]]:
    """Check a levers file's bytes; return (version, {lever: value}) or raise LeversError."""
    if len(raw) > MAX_FILE_BYTES:
        raise LeversError(f"file is {len(raw)} bytes, over the {MAX_FILE_BYTES}-byte limit")
    if not raw.strip():
        raise LeversError("file is empty (truncated write?)")
    if b"\x00" in raw:
        raise LeversError("file contains NUL bytes (binary, not JSON text)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LeversError(f"file is not UTF-8 text (byte {exc.start}): binary content?") from None
    try:
        document = json.loads(text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise LeversError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg} "
                          f"(truncated write, or not JSON)") from None
    if not isinstance(document, dict):
        raise LeversError(f"top level must be a JSON object, got {type(document).__name__}")
    unknown_keys = set(document) - {"version", "levers"}
    if unknown_keys:
        raise LeversError(f"unknown top-level key {sorted(unknown_keys)[0]!r} (expected version, levers)")
    if "version" not in document:
        raise LeversError("missing 'version' (an integer counter)")
    version = document["version"]
    if type(version) is not int or version < 0:
        raise LeversError(f"'version' must be a non-negative integer, got {version!r}")
    values = document.get("levers")
    if not isinstance(values, dict):
        raise LeversError("missing or non-object 'levers' (expected {\"name\": value, ...})")
    for name, value in values.items():
        lever = LEVERS_BY_NAME.get(name)
        if lever is None:
            raise LeversError(f"unknown lever {name!r} (known: {', '.join(LEVERS_BY_NAME)})")
        lever.check(value)
    return version, dict(values)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some filesystems do not allow opening a directory; the replace is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_levers_file(path: str | os.PathLike, version: int, values: LeverValues | Mapping[str, Any]) -> None:
    """Atomically write ``values`` with ``version``: tmp file in the same dir, fsync, os.replace, dir fsync."""
    as_dict = values.as_dict() if isinstance(values, LeverValues) else dict(values)
    body = json.dumps({"version": version, "levers": as_dict}, indent=2, sort_keys=True).encode() + b"\n"
    validate_file_bytes(body)  # never write a file the engine would reject
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(prefix=".levers-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(body)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
        raise
    _fsync_dir(directory)


@dataclass(frozen=True)
class LeversReadResult:
    values: LeverValues                                 # previous values on any error
    version: int | None                                 # None: no file or rejected
    changes: dict[str, tuple[Any, Any]]                 # name -> (old, new) vs previous
    error: str | None = None                            # one line, naming the file


def read_levers_file(path: str | os.PathLike, previous: LeverValues) -> LeversReadResult:
    """Read and validate the levers file; levers it names override ``previous``.

    A missing file is "no overrides" (no error). Any rejection keeps ``previous``.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            raw = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return LeversReadResult(previous, None, {})
    except OSError as exc:
        return LeversReadResult(previous, None, {}, f"{path}: cannot read: {exc.strerror or exc}")
    return levers_from_bytes(raw, previous, path, size=size)


def levers_from_bytes(raw: bytes, previous: LeverValues, source: str, *, size: int | None = None) -> LeversReadResult:
    """Validate levers-file content already read; levers it names override ``previous``."""
    size = len(raw) if size is None else size
    try:
        if size > MAX_FILE_BYTES:
            raise LeversError(f"file is {size} bytes, over the {MAX_FILE_BYTES}-byte limit")
        version, file_values = validate_file_bytes(raw)
        values = previous.replace(**file_values)
    except LeversError as exc:
        return LeversReadResult(previous, None, {}, f"{source}: {exc}")
    return LeversReadResult(values, version, values.changes_from(previous))


def read_levers_version(path: str | os.PathLike) -> int | None:
    """The version of a valid levers file, or None (missing or invalid)."""
    result = read_levers_file(path, defaults())
    return result.version
