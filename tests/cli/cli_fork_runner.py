"""Run many CLI command lines as real processes, cheaply: import once, fork per command line.

Usage: ``python cli_fork_runner.py CASES.json`` where CASES.json is a list of
``{"argv": ["engine" | "telemetry", ...], "timeout_s": float}``; prints one JSON list of
``{"argv", "rc", "stderr", "stdout"}``. Each child runs the package's ``main(argv)`` the way
``python -m PACKAGE`` does (its return value is the exit status, an uncaught exception prints
the interpreter's traceback), so what the parent sees is what a user's shell would see.
Importing torch once instead of once per command line keeps the sweep to seconds.
"""
from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
import traceback

from engine.__main__ import main as engine_main
from telemetry.__main__ import main as telemetry_main

MAINS = {"engine": engine_main, "telemetry": telemetry_main}
PARALLEL = 2


def child(argv: list[str], out_fd: int, err_fd: int) -> None:
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.stdout = os.fdopen(1, "w", closefd=False)
    sys.stderr = os.fdopen(2, "w", closefd=False)
    sys.argv = [f"python -m {argv[0]}", *argv[1:]]
    try:
        status = MAINS[argv[0]](argv[1:])
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status if isinstance(status, int) else 0)


def start(case: dict) -> dict:
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(out_r)
        os.close(err_r)
        child(case["argv"], out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    return {"case": case, "pid": pid, "fds": {out_r: b"", err_r: b""}, "out": out_r, "err": err_r,
            "deadline": time.monotonic() + case.get("timeout_s", 60)}


def finish(job: dict) -> dict:
    _, status = os.waitpid(job["pid"], 0)
    rc = os.waitstatus_to_exitcode(status)
    return {"argv": job["case"]["argv"], "rc": rc, "stdout": job["fds"][job["out"]].decode(errors="replace"),
            "stderr": job["fds"][job["err"]].decode(errors="replace")}


def run_all(cases: list[dict]) -> list[dict]:
    todo, running, results = list(cases), [], []
    while todo or running:
        while todo and len(running) < PARALLEL:
            running.append(start(todo.pop(0)))
        open_fds = {fd: job for job in running for fd in job["fds"] if fd not in job.get("closed", set())}
        ready, _, _ = select.select(list(open_fds), [], [], 0.2)
        for fd in ready:
            chunk = os.read(fd, 65536)
            job = open_fds[fd]
            if chunk:
                job["fds"][fd] += chunk
            else:
                os.close(fd)
                job.setdefault("closed", set()).add(fd)
        for job in list(running):
            if len(job.get("closed", ())) == 2:
                running.remove(job)
                results.append(finish(job))
            elif time.monotonic() > job["deadline"]:
                os.kill(job["pid"], signal.SIGKILL)
                job["fds"][job["err"]] += b"\n<killed: timed out>"
                job["deadline"] = float("inf")
    order = {json.dumps(c["argv"]): i for i, c in enumerate(cases)}
    return sorted(results, key=lambda r: order[json.dumps(r["argv"])])


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        print(json.dumps(run_all(json.load(handle))))
