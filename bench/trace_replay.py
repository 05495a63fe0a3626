"""Replay a slice of a production trace through ``python -m engine serve`` and report how it went.

The reference trace is the Azure LLM inference trace 2023, conversation service
(``azure_conv_2023.csv``; Azure/AzurePublicDataset, CC-BY; Patel et al., "Splitwise:
Efficient Generative LLM Inference Using Phase Splitting", ISCA 2024). A small machine
replays it scaled: ``--time-scale`` multiplies inter-arrival gaps, ``--length-scale``
prompt and output lengths (both are stored in the run row).

The engine runs as the product runs it (a ``serve`` process writing telemetry); the
numbers are read back from its telemetry store: requests per end state and errors
(error + preempted + rejected), output and
total tokens/s over the engine's busy span, TTFT p50/p99 (nearest rank), preemptions,
prefix-hit token ratio, and the wall time of the whole replay.

    python bench/trace_replay.py [--trace PATH] [--limit 500] [--time-scale 1.0]
                                 [--length-scale 0.1] [--kv-blocks 512] [--ssm-slots 32]
                                 [--no-prefix-cache] [--run-dir DIR]
"""
from __future__ import annotations

import argparse
import math
import shlex
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Run as a script, bench/ comes first on sys.path and bench/telemetry.py would shadow the
# telemetry package; the repo root (or the installed package) is what is meant.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(REPO)

from telemetry import events as ev  # noqa: E402
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "azure_conv_2023.csv"


def nearest_rank(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank (the same definition the dashboard uses)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def serve_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "engine", "serve", "--model", args.model, "--run-dir", str(run_dir),
            "--workload", f"trace:{args.trace}", "--limit", str(args.limit), "--start", str(args.start),
            "--time-scale", str(args.time_scale), "--length-scale", str(args.length_scale),
            "--kv-blocks", str(args.kv_blocks), "--ssm-slots", str(args.ssm_slots), "--seed", str(args.seed),
            "--prefix-cache" if args.prefix_cache else "--no-prefix-cache"]


def report(db_path: Path) -> dict:
    """Numbers of the newest run in ``db_path``."""
    if not db_path.exists():
        raise SystemExit(f"error: the engine wrote no telemetry store at {db_path}")
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    run_id, status = db.execute("SELECT run_id, status FROM runs ORDER BY run_id DESC LIMIT 1").fetchone()
    rows = db.execute("SELECT status, arrival_ns, first_token_ns, finished_ns, prompt_len, output_len, "
                      "prefix_hit_tokens FROM requests WHERE run_id = ?", (run_id,)).fetchall()
    finished = [r for r in rows if r["status"] == "finished"]
    ttft_s = [(r["first_token_ns"] - r["arrival_ns"]) / 1e9 for r in finished]
    span_ns = max(r["finished_ns"] for r in finished) - min(r["arrival_ns"] for r in rows) if finished else 0
    num_output = sum(r["output_len"] for r in finished)
    num_prompt = sum(r["prompt_len"] for r in finished)
    num_preemptions = db.execute("SELECT COUNT(*) FROM preemptions WHERE run_id = ?", (run_id,)).fetchone()[0]
    num_ticks = db.execute("SELECT COUNT(*) FROM ticks WHERE run_id = ?", (run_id,)).fetchone()[0]
    return {
        "run_id": run_id, "run_status": status, "num_requests": len(rows), "num_finished": len(finished),
        "end_states": {status: sum(1 for r in rows if r["status"] == status) for status in ev.END_STATUSES},
        "num_running": sum(1 for r in rows if r["status"] in ev.IN_FLIGHT_STATUSES),
        "num_errors": sum(1 for r in rows if r["status"] in ev.FAILURE_STATUSES),
        "num_preemptions": num_preemptions, "num_ticks": num_ticks,
        "output_tok_s": num_output / (span_ns / 1e9) if span_ns else 0.0,
        "total_tok_s": (num_output + num_prompt) / (span_ns / 1e9) if span_ns else 0.0,
        "ttft_p50_s": nearest_rank(ttft_s, 0.5) if ttft_s else None,
        "ttft_p99_s": nearest_rank(ttft_s, 0.99) if ttft_s else None,
        "prefix_hit_ratio": sum(r["prefix_hit_tokens"] for r in rows) / max(1, sum(r["prompt_len"] for r in rows)),
        "span_s": span_ns / 1e9, "mean_prompt_len": num_prompt / max(1, len(finished)),
        "mean_output_len": num_output / max(1, len(finished)),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--model", default="tiny")
    p.add_argument("--limit", type=int, default=500)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="1.0 keeps the trace pacing (500 rows = 129 s); < 1 compresses it into an overload")
    p.add_argument("--length-scale", type=float, default=0.1)
    p.add_argument("--kv-blocks", type=int, default=512)
    p.add_argument("--ssm-slots", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--run-dir", type=Path, default=None, help="keep the run here (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the replay is abandoned")
    args = p.parse_args()
    if not args.trace.exists():
        p.error(f"--trace {args.trace}: no such file")

    with tempfile.TemporaryDirectory(prefix="chunkscope-trace-") as tmp:
        run_dir = args.run_dir or Path(tmp)
        command = serve_command(args, run_dir)
        print("command:", shlex.join(["python", *command[1:]]), flush=True)
        start = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, timeout=args.timeout)
        wall_s = time.perf_counter() - start
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"error: engine serve exited with {done.returncode}")
        numbers = report(run_dir / "telemetry.db")

    print(f"trace: {args.trace.name} rows {args.start}..{args.start + args.limit - 1}, time scale "
          f"{args.time_scale}, length scale {args.length_scale} (Azure LLM inference trace 2023, "
          f"Patel et al., Splitwise, ISCA 2024, CC-BY)")
    n = numbers
    print(f"requests {n['num_requests']}: " + ", ".join(f"{s} {k}" for s, k in n["end_states"].items()) +
          f", still running {n['num_running']}; errors {n['num_errors']} ({' + '.join(ev.FAILURE_STATUSES)}); "
          f"preemptions {n['num_preemptions']}, run status {n['run_status']}")
    print(f"mean prompt {n['mean_prompt_len']:.0f} tokens, mean output {n['mean_output_len']:.0f} tokens, "
          f"{n['num_ticks']} ticks")
    print(f"output tokens/s {n['output_tok_s']:.1f}, prompt+output tokens/s {n['total_tok_s']:.1f} "
          f"over {n['span_s']:.1f} s busy")
    if n["ttft_p50_s"] is not None:
        print(f"TTFT p50 {n['ttft_p50_s'] * 1e3:.0f} ms, p99 {n['ttft_p99_s'] * 1e3:.0f} ms")
    print(f"prefix-hit token ratio {n['prefix_hit_ratio']:.3f}")
    print(f"wall time {wall_s:.1f} s (model load and telemetry drain included)")
    return 0 if n["num_errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
