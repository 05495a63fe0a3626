"""``python -m engine serve``: the engine as a background process writing telemetry to a run directory
(its options: ``engine/cli/serve.py``).

It loads a model, feeds a workload into the scheduler as its arrival times
come due, applies lever-file changes between ticks, and on SIGTERM / Ctrl-C
drains the telemetry queue, marks the run finished and exits 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sqlite3
import sys
import time
from pathlib import Path

import torch

from engine.multimodal.image_store import IMAGES_DIR, ImageStore
from engine.distributed import launch, serve_ranks
from engine.distributed.group import StartMismatch
from engine.distributed.worker import EXIT_RANK_FAILURE
from engine.api.launch import api_key, start_api
from engine.serve.driver import ApiInbox, LeverFile, TickDriver, TimedArrivals, submit_spec
from engine.serve.engine_setup import EngineSetup, build_engine, log_roofline, run_started_row
from engine.cli.kv_cache_args import kv_cache_options
from engine.serve.lever_watch import LeverWatcher
from engine.model.fault import ENV_VAR as FAULT_ENV_VAR, ForwardFault
from engine.serve.run_dir_lock import lock_run_dir
from engine.serve.stall_watch import STALL_WAIT_S, StallWatch
from engine.model.errors import RankFailure
from engine.workload.request import RequestSpec
from engine.serve.workload_feed import WorkloadFeed
from telemetry.levers import defaults, from_env
from telemetry.engine_status import StatusReporter
from telemetry.crashed_runs import mark_crashed_runs
from telemetry.writer import TelemetryWriteError, TelemetryWriter
from telemetry import events as ev

log = logging.getLogger("chunkscope.serve")
IDLE_SLEEP_S = 0.02
DONE_KEPT = 1024  # ended requests held in memory by an endless server (their rows are in SQLite)


def run(args: argparse.Namespace) -> int:
    rank, from_torchrun = launch.rank_of(args.ep)
    if rank > 0:  # torchrun started this rank with the serve command line
        return serve_ranks.run_torchrun_rank(args, rank)
    run_dir = Path(args.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"--run-dir {run_dir}: exists and is not a directory (or sits under a file)") from None
    except OSError as exc:
        raise ValueError(f"--run-dir {run_dir}: cannot create it: {exc.strerror or exc}") from None
    lock = lock_run_dir(run_dir)   # a second engine on this directory stops here, before touching its files
    _setup_logging(run_dir)
    db_path = run_dir / "telemetry.db"
    base_levers = from_env(os.environ)
    fault = ForwardFault.from_env(os.environ)
    if fault is not None:
        log.warning("test fault hook %s armed: forwards carrying %s will raise", FAULT_ENV_VAR, fault.describe())
    setup = build_engine(args.model, kv_blocks=args.kv_blocks, ssm_slots=args.ssm_slots,
                         levers=base_levers, seed=args.seed, prefix_cache=args.prefix_cache,
                         threads=args.threads, fault=fault, kv_cache=kv_cache_options(args), dtype=args.dtype,
                         ep_size=args.ep, compile=args.compile, measure_roofline=True,
                         numerics=args.numerics, image_store=ImageStore(run_dir / IMAGES_DIR),
                         image_limits=args.limit_mm_per_prompt)
    feed = WorkloadFeed.from_args(args, setup)   # a bad workload fails in one line, before any rank starts
    ep_run, start_failure = None, None
    if args.ep > 1:
        try:
            ep_run = serve_ranks.start(args, setup, from_torchrun, run_dir)
        except (StartMismatch, RankFailure) as exc:   # the ranks disagree, or one never answered
            start_failure = exc
    if start_failure is not None:
        return _fail_at_start(db_path, setup, args, feed, start_failure, lock)
    log_roofline(setup, log)
    writer, telemetry_error = None, None
    # Before the API listens: a client that saw it up and sends SIGTERM gets a drained stop, not a kill.
    stop = _install_stop_handlers()
    api = start_api(args, setup, lambda: writer.num_dropped if writer is not None else 0)
    if api is not None:
        feed.describe_api(api.url, key_required=api_key(args) is not None)
    if not args.no_telemetry:
        writer, telemetry_error = _open_telemetry(db_path, setup, args, feed)
    sched = setup.scheduler
    if api is not None:  # /metrics sees every event the writer sees; first tokens go out as sampled
        sched.attach_telemetry(api.tee(writer.emit if writer is not None else None))
    sched.keep_recent_done(DONE_KEPT)
    status_file = StatusReporter(run_dir)
    _log_env_levers(sched)
    watcher = LeverWatcher(run_dir / "levers.json", base_levers)
    stall = StallWatch()
    status, exit_code = "finished", 0
    t_start = time.monotonic()

    def heartbeat(sched, force: bool = False) -> None:
        status_file.maybe_write(_status_fields(sched, writer, telemetry_error, "serving", stall), force=force)

    housekeeping = [lambda s: _report_writer_health(s, writer), heartbeat]
    if ep_run is not None:   # idle or stalled: the ranks hear from rank 0 before their timeout
        housekeeping.insert(0, lambda _s: ep_run.leader.keepalive())
    arrivals = TimedArrivals(feed, lambda: time.monotonic() - t_start, on_submit=_submit,
                             new_request_id=api.new_request_id if api is not None else None)
    driver = TickDriver(sched, ([ApiInbox(api)] if api is not None else []) + [arrivals, LeverFile(watcher, log)],
                        before_step=housekeeping, stall=stall)
    log.info("serving %s, run dir %s, workload %s", args.model, run_dir, feed.describe().get("kind"))
    try:
        while not stop["now"]:
            elapsed = time.monotonic() - t_start
            if args.duration is not None and elapsed >= args.duration:
                break
            outcome = driver.tick()
            next_arrival_s = max(0.0, feed.next_arrival_s() - elapsed)
            if outcome.stalled:
                if outcome.blocker_changed:   # a new blocker reaches the heartbeat at once
                    heartbeat(sched, force=True)
                # Nothing can run until a lever changes, a request arrives or a stop comes.
                wait_s = min(STALL_WAIT_S, next_arrival_s)
                if api is not None:   # an API request (or a cancel that frees room) may end the stall too
                    api.wait(min(wait_s, IDLE_SLEEP_S))
                else:
                    watcher.wait_for_change(wait_s)
            elif outcome.had_work:
                continue
            elif feed.is_exhausted and api is None:
                break
            else:
                idle_s = min(IDLE_SLEEP_S, next_arrival_s)
                api.wait(idle_s) if api is not None else time.sleep(idle_s)
    except RankFailure as exc:  # a dead or hung rank ends the whole run, never only its requests
        log.error("run failed at tick %d: %s", sched.tick, exc)
        status, exit_code = "failed", EXIT_RANK_FAILURE
        record_failure(sched, str(exc))
    except Exception:
        log.exception("engine loop failed")
        status = "error"
        raise
    finally:
        if ep_run is not None:
            ep_run.close(failed=status != "finished")
        watcher.stop()
        sched.stop(**({"reason": "the run failed: an expert-parallel rank died or hung"}
                      if status == "failed" else {}))
        if api is not None:
            api.close(sched)
        if writer is not None:
            writer.close(status)
        status_file.maybe_write(_status_fields(sched, writer, telemetry_error, status, stall), force=True)
        log.info("run %s after %d ticks", status, sched.tick)
        if lock is not None:
            lock.close()
    return exit_code


def record_failure(sched, reason: str) -> None:
    """The reason a run failed, as one ``run_failed`` event (the Runs page shows it next to the status)."""
    sched.emit(ev.GenericEvent(tick=sched.tick, t_ns=sched.now_ns(), kind=ev.EVENT_RUN_FAILED,
                               detail={"reason": reason}))


def _fail_at_start(db_path: Path, setup: EngineSetup, args, feed, failure: Exception, lock) -> int:
    """The expert-parallel start failed: a run row with status ``failed`` and the reason, then exit
    (2 for ranks started with different settings, 3 for a rank that never answered)."""
    log.error("run failed at start: %s", failure)
    writer = None if args.no_telemetry else _open_telemetry(db_path, setup, args, feed)[0]
    if writer is not None:
        record_failure(setup.scheduler, str(failure))
        writer.close("failed")
    if lock is not None:
        lock.close()
    return 2 if isinstance(failure, StartMismatch) else EXIT_RANK_FAILURE


def _open_telemetry(db_path: Path, setup: EngineSetup, args, feed) -> tuple[TelemetryWriter | None, str | None]:
    """The writer for a new run, or (None, why) when the store cannot be used at all.

    A read-only or full disk must not stop the engine: it serves without
    telemetry, says so loudly in the log, and the status file carries the error.
    """
    try:
        crashed = mark_crashed_runs(db_path)
        if crashed:
            log.warning("marked runs %s as crashed (left running by a dead engine)", crashed)
        writer = TelemetryWriter(db_path)
    except (sqlite3.Error, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    else:
        try:
            writer.start_run(run_started_row(setup, args, feed.describe(), sys.argv))
            setup.scheduler.attach_telemetry(writer.emit)
            return writer, None
        except TelemetryWriteError as exc:
            writer.close("error", timeout_s=1.0)
            error = str(exc)
    log.error("telemetry disabled, engine keeps serving without it: cannot use %s: %s", db_path, error)
    return None, error


def _status_fields(sched, writer, telemetry_error: str | None, state: str, stall: StallWatch) -> dict:
    """What the heartbeat file says: progress, queue sizes, caches, the blocker and telemetry health."""
    return {
        **stall.status_fields(sched),
        "state": state, "run_id": writer.run_id if writer is not None else None, "tick": sched.tick,
        "run_t_ns": sched.now_ns(),   # the run's clock: the Live timeline ends an open stall here
        "num_waiting": len(sched.waiting), "num_active": len(sched.active),
        "num_prefilling": int(sched.prefilling is not None), "num_done": sched.num_done,
        "num_preemptions": sched.num_preemptions,
        "telemetry": "off" if writer is None and telemetry_error is None else
                     "failing" if (writer.error if writer is not None else telemetry_error) else "ok",
        "telemetry_error": writer.error if writer is not None else telemetry_error,
        "num_dropped": writer.num_dropped if writer is not None else 0,
        "flushed_events": writer.flushed_events if writer is not None else 0,
        "writer_wait_ns": writer.writer_wait_ns if writer is not None else 0,
    }


def _submit(sched, spec: RequestSpec):
    request = submit_spec(sched, spec)
    if request.status == ev.REQ_REJECTED:
        log.warning("request %d rejected: %s", spec.request_id, request.error)
    return request


def _log_env_levers(sched) -> None:
    """Levers the environment set (and the engine kept) are logged once, at tick 0, with source 'env'."""
    for name, (old, new) in sched.levers.changes_from(defaults()).items():
        sched.emit(ev.LeverChange(tick=0, t_ns=0, name=name, old=old, new=new, source="env",
                                  status="applied"))


_last_health: dict[str, str | None] = {"error": None}


def _report_writer_health(sched, writer) -> None:
    """A failing store is reported loudly once per new error; the engine keeps serving."""
    if writer is None or writer.error == _last_health["error"]:
        return
    _last_health["error"] = writer.error
    if writer.error is not None:
        log.error("telemetry store failing (engine keeps serving, %d events dropped so far): %s",
                  writer.num_dropped, writer.error)
    else:
        log.warning("telemetry store recovered")


def _install_stop_handlers() -> dict[str, bool]:
    stop = {"now": False}

    def handler(signum, _frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def _setup_logging(run_dir: Path) -> None:
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger("chunkscope")
    root.setLevel(logging.INFO)
    # A full disk makes every engine.log write fail; the engine must keep serving, and a
    # logging traceback per line would bury the one error that matters.
    logging.raiseExceptions = False
    if not root.handlers:
        handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
        file_error = None
        if not _is_same_file(sys.stderr, run_dir / "engine.log"):  # the dashboard sends stderr there already
            try:
                handlers.append(logging.FileHandler(run_dir / "engine.log"))
            except OSError as exc:  # an unwritable run dir: serve anyway, stderr is the only log
                file_error = f"cannot write {run_dir / 'engine.log'}: {exc.strerror or exc}; logging to stderr only"
        for handler in handlers:
            handler.setFormatter(fmt)
            root.addHandler(handler)
        if file_error:
            log.error(file_error)


def _is_same_file(stream, path: Path) -> bool:
    """True when ``stream`` already writes ``path`` (a second handler would log every line twice)."""
    try:
        mine, theirs = os.fstat(stream.fileno()), os.stat(path)
    except (OSError, ValueError, AttributeError):
        return False
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)
