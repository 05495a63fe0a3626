"""Start and stop a background engine process from the dashboard, without importing it.

The engine runs as ``python -m engine serve ...`` in its own session (so a
Ctrl-C in the dashboard's terminal does not reach it, and SIGTERM to its
group stops it with its children). A JSON pid file in the run dir records the
pid and the exact argv; liveness checks the pid *and* that its command line
still matches, so a recycled pid is never mistaken for our engine.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dashboard.engine_api_options import ApiOptionError, ApiOptions
from dashboard.paths import PathOutsideRunDir, RunPaths, inside_run_dir
from telemetry.procs import is_zombie

BUILTIN_MODELS = ("tiny", "tiny-chat", "tiny-chat-moe")
WORKLOADS = ("synthetic", "chat", "multiturn")
MAX_RATE = 1000.0
REPO_ROOT = Path(__file__).resolve().parent.parent


class EngineControlError(RuntimeError):
    """A start / stop request that cannot be carried out; the message says why."""


@dataclass(frozen=True)
class EngineStatus:
    is_running: bool
    pid: int | None
    argv: tuple[str, ...]
    note: str                      # one human sentence: why we think so


def engine_argv(paths: RunPaths, model: str, workload: str, rate: float) -> list[str]:
    """Validate the form fields and build the engine command line."""
    if workload not in WORKLOADS:
        raise EngineControlError(f"workload {workload!r} is not one of {', '.join(WORKLOADS)}")
    try:
        rate = float(rate)
    except (TypeError, ValueError):
        raise EngineControlError(f"rate {rate!r} is not a number") from None
    if not 0 < rate <= MAX_RATE:
        raise EngineControlError(f"rate must be in (0, {MAX_RATE:g}] requests/s, got {rate:g}")
    if model not in BUILTIN_MODELS:
        try:  # a checkpoint directory: only accepted inside the run dir
            model_dir = inside_run_dir(paths.run_dir, model)
        except PathOutsideRunDir as exc:
            raise EngineControlError(f"model: {exc}") from None
        try:
            is_dir = model_dir.is_dir()
        except OSError as exc:     # a name too long for the file system, a permission problem
            raise EngineControlError(f"model: {exc.strerror or exc}") from None
        if not is_dir:
            raise EngineControlError(f"model: {model_dir} is not a directory")
        model = str(model_dir)
    return [sys.executable, "-m", "engine", "serve", "--model", model, "--run-dir", str(paths.run_dir),
            "--workload", workload, "--rate", f"{rate:g}"]


def _proc_cmdline(pid: int) -> tuple[str, ...] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return tuple(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def _reap(pid: int) -> None:
    """Collect an exited child we started, so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def read_pid_file(paths: RunPaths) -> tuple[int | None, tuple[str, ...]]:
    try:
        record = json.loads(paths.pid_file.read_text())
        return int(record["pid"]), tuple(record.get("argv", ()))
    except FileNotFoundError:
        return None, ()
    except (OSError, ValueError, KeyError, TypeError):
        return None, ()


def engine_status(paths: RunPaths) -> EngineStatus:
    pid, argv = read_pid_file(paths)
    if pid is None:
        return EngineStatus(False, None, (), f"no engine started from this dashboard ({paths.pid_file.name} absent)")
    if is_zombie(pid):
        _reap(pid)
        return EngineStatus(False, pid, argv, f"engine pid {pid} has exited")
    cmdline = _proc_cmdline(pid)
    if cmdline is None:
        return EngineStatus(False, pid, argv, f"engine pid {pid} is not running")
    if argv and cmdline != argv:
        return EngineStatus(False, pid, argv, f"pid {pid} now belongs to another program")
    return EngineStatus(True, pid, argv, f"engine running as pid {pid}")


def launch(paths: RunPaths, argv: list[str], env: dict[str, str | None] | None = None) -> int:
    """Start ``argv`` in the background in its own session (``env``: changes to this process's
    environment, None removing a variable); record it in the pid file."""
    status = engine_status(paths)
    if status.is_running:
        raise EngineControlError(f"an engine is already running (pid {status.pid}); stop it first")
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    with open(paths.engine_log, "ab") as log:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=_environment(env))
    tmp = paths.pid_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": proc.pid, "argv": argv, "started_at": time.time()}))
    os.replace(tmp, paths.pid_file)
    return proc.pid


def _environment(changes: dict[str, str | None] | None) -> dict[str, str] | None:
    if not changes:
        return None
    env = {**os.environ, **{k: v for k, v in changes.items() if v is not None}}
    return {k: v for k, v in env.items() if changes.get(k, "") is not None}


def start_engine(paths: RunPaths, model: str = "tiny", workload: str = "synthetic", rate: float = 4.0,
                 api: ApiOptions = ApiOptions(), api_port: str | int | None = None, api_key: str = "") -> int:
    """Start an engine; with ``api_port`` (blank: none) it serves the API with ``api``'s other options."""
    argv = engine_argv(paths, model, workload, rate)
    try:
        api_argv, env = api.argv_and_env(api_port, api_key)
    except ApiOptionError as exc:
        raise EngineControlError(str(exc)) from None
    return launch(paths, argv + api_argv, env)


def stop_engine(paths: RunPaths, timeout_s: float = 10.0) -> str:
    """SIGTERM the engine's process group (it drains its telemetry), SIGKILL after ``timeout_s``."""
    status = engine_status(paths)
    if not status.is_running or status.pid is None:
        paths.pid_file.unlink(missing_ok=True)
        return f"nothing to stop: {status.note}"
    pid = status.pid
    os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and engine_status(paths).is_running:
        time.sleep(0.05)
    if engine_status(paths).is_running:
        os.killpg(pid, signal.SIGKILL)
        _reap(pid)
        message = f"engine pid {pid} ignored SIGTERM for {timeout_s:g} s and was killed"
    else:
        message = f"engine pid {pid} stopped"
    paths.pid_file.unlink(missing_ok=True)
    return message
