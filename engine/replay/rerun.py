"""``python -m engine replay BUNDLE.zip``: re-run a recorded workload and prove it reproduces (the command
and its report: ``engine/cli/replay.py``).

The replay rebuilds the engine with the run's config (KV blocks, SSM slots,
seed, device, dtype) on the same checkpoint (its hash is checked), then
drives the scheduler the way ``serve`` did, keyed by tick instead of wall
time: before each tick's step it submits the requests recorded as arriving
at that tick and applies the lever changes recorded at that tick. Idle spells
cost no tick, so a request that arrived while the engine idled is submitted
as soon as the replay idles. A run that was stopped (SIGTERM, crash) is cut
after the same number of ticks. The result is compared decision by decision
and token by token (``compare.py``).

``--flip NAME=VALUE`` overrides a lever for the whole replay (it wins over the
recorded timeline) and runs every request to its end: the bisect workflow,
where decisions are expected to differ and tokens, for a batch-invariant
engine, are not.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.replay import flips as replay_flips, stall_report
from engine.serve.driver import LeverTimeline, TickArrivals, TickCancels, TickDriver, run_arrivals
from engine.serve.engine_setup import build_engine, checkpoint_dir_of, checkpoint_hash
from engine.cache.kv_options import OPTION_KEYS
from engine.model.embedded import EMBEDDED_MODELS
from engine.model.fault import ForwardFault
from engine.model.reproducible import NATIVE
from engine.replay.compare import ReplayedRequest, ReplayedRun
from engine.multimodal.image_store import IMAGES_DIR, ImageStore
from engine.multimodal.limits import ImageLimits
from engine.replay.record import RecordedRun, ReplayInputError, load_recorded_run
from engine.replay.run_dtype import replay_dtype
from engine.scheduler.request_features import CLIENT_DISCONNECTED
from engine.scheduler.loop import CANCELLED_PREFIX
from telemetry import events as ev
from telemetry.levers import LEVERS_BY_NAME, LeverValues, defaults

log = logging.getLogger("chunkscope.replay")


def load_input(path: str, run_id: int | None = None) -> tuple[RecordedRun, dict[str, Any] | None]:
    """A bundle zip (through ``telemetry.bundle``) or a telemetry store; returns (run, manifest or None)."""
    if path.endswith(".zip"):
        from telemetry.bundle import BundleError, open_bundle
        if not os.path.isfile(path):
            raise ReplayInputError(f"{path}: no such bundle")
        try:
            bundle = open_bundle(path)
        except BundleError as exc:
            raise ReplayInputError(str(exc)) from None
        with bundle:  # everything is read into memory; the extracted files go at once
            time_range = bundle.manifest.get("time_range") or {}
            if time_range.get("is_windowed"):
                raise ReplayInputError(f"{path}: a time-windowed bundle holds only part of the run; "
                                       f"export the whole run to replay it")
            recorded = load_recorded_run(bundle.db_path, bundle.run_id if run_id is None else run_id)
            recorded.images = read_images(bundle.images_dir)
        recorded.source = path
        return recorded, bundle.manifest
    if os.path.isdir(path):
        path = os.path.join(path, "telemetry.db")
    if not os.path.exists(path):
        raise ReplayInputError(f"{path}: no such bundle or telemetry store")
    recorded = load_recorded_run(path, run_id)
    recorded.images = read_images(Path(path).parent / IMAGES_DIR)
    return recorded, None


def read_images(directory: Path) -> dict[str, bytes]:
    """The images of a run (a run directory's or a bundle's ``images/``), by content hash."""
    store = ImageStore(directory)
    return {key: store.get(key) for key in store.hashes()}


def resolve_model(recorded: RecordedRun, model: str | None, *, ignore_hash: bool) -> tuple[str, list[str]]:
    """The model to load and any warnings; refuses a checkpoint whose hash differs from the run's."""
    if model is None:
        if recorded.model not in EMBEDDED_MODELS:  # an embedded model is rebuilt from its seed here
            raise ReplayInputError(f"run {recorded.run_id} used checkpoint {recorded.model!r}: "
                                   f"pass --model DIR pointing at it")
        model = recorded.model
    directory = checkpoint_dir_of(model)
    if not directory.is_dir():
        raise ReplayInputError(f"--model {model}: no such checkpoint directory")
    found = checkpoint_hash(directory)
    if not recorded.checkpoint_hash or found == recorded.checkpoint_hash:
        return model, [] if recorded.checkpoint_hash else ["the run recorded no checkpoint hash; weights unchecked"]
    message = (f"checkpoint {directory} has hash {found[:12]}, the run used {recorded.checkpoint_hash[:12]}: "
               f"tokens cannot be expected to match")
    if not ignore_hash:
        raise ReplayInputError(message + " (pass --ignore-checkpoint-hash to replay anyway)")
    return model, ["warning: " + message]


def recorded_kv_cache(config: dict[str, Any]) -> dict[str, Any]:
    """The KV cache options a run recorded (a run from before they existed: full precision)."""
    return {"kv_cache_dtype": "auto", **{k: config[k] for k in OPTION_KEYS if config.get(k) is not None}}


def _lever_values(values: dict[str, Any]) -> LeverValues:
    known = {k: v for k, v in values.items() if k in LEVERS_BY_NAME}
    return defaults().replace(**known)


def recorded_numerics(config: dict[str, Any]) -> str:
    """The numerics mode a run recorded (a run from before the mode existed: native)."""
    return str(config.get("numerics") or NATIVE)


@torch.no_grad()   # inference only; scoped, so the caller's grad mode is left as it was
def replay_run(recorded: RecordedRun, *, model: str = "tiny", flips: dict[str, Any] | None = None,
               device: str | None = None, kv_cache: dict[str, Any] | None = None,
               numerics: str | None = None, progress: Callable[[int], None] | None = None) -> ReplayedRun:
    """Re-run ``recorded`` on ``model`` (checked by the caller) and collect what the engine did.

    ``kv_cache``: KV cache options; by default the run's own (format, byte budget, InnerQ windows).
    ``numerics``: 'reproducible' / 'native'; by default the mode the run recorded (``recorded_numerics``).
    ``progress(tick)``: called before each step (the CLI's tqdm bar)."""
    flips = dict(flips or {})
    config = recorded.config
    device = device or config.get("device") or None
    if device and device.startswith("cuda") and not torch.cuda.is_available():
        device = "cpu"
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = replay_dtype(config, device)   # the run's own dtype, or a one-line refusal
    dtype = getattr(torch, dtype_name)
    levers = _lever_values(recorded.start_levers).replace(**flips)
    rows: dict[type, list] = {ev.ChunkDecision: [], ev.Tick: [], ev.TokenEvent: []}

    def collect(event: Any) -> None:
        bucket = rows.get(type(event))
        if bucket is not None:
            bucket.append(event)

    image_store = ImageStore()
    for data in recorded.images.values():
        image_store.put(data)
    setup = build_engine(model, kv_blocks=config["kv_blocks"], ssm_slots=config["ssm_slots"],
                         levers=levers, seed=int(config.get("seed", 0)), device=device, dtype=dtype,
                         emit=collect,  # only the rows a comparison needs are kept
                         fault=ForwardFault.parse(config["fault_forward"]) if config.get("fault_forward") else None,
                         kv_cache=kv_cache if kv_cache is not None else recorded_kv_cache(config),
                         numerics=numerics or recorded_numerics(config), image_store=image_store,
                         image_limits=ImageLimits.from_dict(config["image_limits"]) if "image_limits" in config else None)
    sched = setup.scheduler
    replay_flips.check_model_can_honour(flips, setup.model)
    submitted, levers = drive(sched, recorded, flips, cut_at_tick=None if flips else recorded.num_ticks,
                              cut_lengths=replay_flips.recorded_cut_lengths(recorded) if flips else None,
                              progress=progress)
    # From the submitted objects, in submission order (``sched.done`` holds them in end order).
    done = {r.request_id: ReplayedRequest(r.request_id, r.status, r.error, list(r.output_tokens))
            for r in submitted}
    return ReplayedRun(rows[ev.ChunkDecision], rows[ev.Tick], rows[ev.TokenEvent], done, levers.log,
                       blocked=levers.blocked, ttft_ms=stall_report.ttft_ms(submitted),
                       dtype=dtype_name, device=device, model=setup.model)


def drive(sched, recorded: RecordedRun, flips: dict[str, Any], *, cut_at_tick: int | None,
          cut_lengths: dict[int, int] | None = None,
          progress: Callable[[int], None] | None = None) -> tuple[list[Any], LeverTimeline]:
    """Submit arrivals and apply lever changes at their recorded ticks, stepping like ``serve``.

    ``cut_lengths``: requests the recording cut short end where it did (a flipped replay).

    Returns the submitted Request objects (in submission order) and the lever timeline (its
    ``log`` of applies and where no step was possible after one)."""
    arrivals = TickArrivals(recorded.requests, lambda r: r.arrival_tick)
    # API clients that went away: cancelled again at the tick boundary where the engine cancelled them.
    gone = sorted((r for r in recorded.requests if r.status == ev.REQ_CANCELLED and
                   r.error == f"{CANCELLED_PREFIX}{CLIENT_DISCONNECTED}"), key=lambda r: r.tick)
    disconnects = [] if flips else [(r.tick, r.request_id) for r in gone]
    levers = LeverTimeline(recorded.lever_changes, flips)
    cut = [lambda s: replay_flips.cut_where_recorded(s, cut_lengths)] if cut_lengths else []
    shown = [lambda s: progress(s.tick)] if progress is not None else []
    driver = TickDriver(sched, [arrivals, TickCancels(disconnects, CLIENT_DISCONNECTED), levers],
                        before_step=cut + shown)
    # Idle spells cost no tick: serve slept until the next arrival, so it was recorded at this tick
    # (later only when a flip changed pace).
    run_arrivals(driver, arrivals, cut_at_tick=cut_at_tick)
    driver.boundary()  # arrivals and levers logged at the final tick, never stepped
    sched.stop()
    return arrivals.submitted, levers
