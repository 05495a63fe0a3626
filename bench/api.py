"""64 concurrent streaming HTTP clients vs the same arrivals fed in-process, in one run.

Both sides run ``python -m engine serve`` on the tiny model with the same engine settings
and the same requests (token-id prompts, greedy, a fixed output length, ``logprobs: 0`` so
every token is one server-sent event) arriving at the same times:

- API: ``--workload none --api-port P``; a lean asyncio client (one raw loopback HTTP/1.1
  connection per request, all 64 at once at most) sends each request at its arrival time as a
  streaming completion and timestamps the first ``data:`` bytes (TTFT as the client sees it)
  and the end of the stream; it parses the events only after the stream has ended, so 64
  clients' JSON parsing on the same cores is not counted as the server's latency. (The tests
  drive the API through ``httpx`` and the official ``openai`` client.)
- in-process: ``--workload bundle:workload.jsonl`` with those arrivals; TTFT and finish times
  come from the run's telemetry store (first_token_ns - arrival_ns).
- API (thread), with ``--thread-side``: the API side again with ``--no-api-process`` (the HTTP
  server as a thread of the engine, sharing its GIL), to show what the frontend process buys.

A share of the requests (``--n4-share``, default 1 in 4) asks for ``n = 4`` sampled choices
(seeded): the API fans each out into 4 sibling engine requests sharing the prompt through the
prefix cache; the in-process side feeds the same 4 siblings (``features.n`` / ``choice``, seeds
seed + i), so both sides run the same engine requests. TTFT of an n = 4 request is its first
choice's first token on both sides.

Printed: each round as it ends, with the machine's load average (1 min) then; then the
medians of interleaved rounds: output tokens/s over first arrival .. last finish and TTFT p50
on both sides (in-process TTFT counts from when a request was due, as the client's clock
starts when it sends), the throughput ratio (API / in-process, target >= 0.9), the TTFT the
API adds (target <= 5 ms), and the CPU seconds of the engine, of its frontend process and
of the client: on a machine with fewer free cores than engine + frontend + clients need, the
wall-clock ratio measures CPU share, and tokens per engine CPU-second isolates what the API costs.

    python bench/api.py [--clients 64] [--max-tokens 64] [--rate 24] [--rounds 3] [--seed 0] [--n4-share 0.25]
                        [--thread-side]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.model.cpu_features import cpu_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WARMUP = 2                  # requests before the measured ones, excluded from the numbers
MEASURED_START_S = 1.0      # measured arrivals start here (after the warm-up requests)



N_CHOICES = 4               # the n of the requests that ask for several choices


def arrivals(args) -> list[dict]:
    """Warm-up requests at t=0, then ``clients`` Poisson arrivals at ``rate``/s; every request whose
    index falls on the ``n4_share`` grid asks for 4 seeded choices, the rest for one greedy one."""
    rng = random.Random(args.seed)
    t, out = MEASURED_START_S, []
    for i in range(WARMUP + args.clients):
        if i >= WARMUP:
            t += rng.expovariate(args.rate)
        prompt = [rng.randrange(32, 127) for _ in range(rng.randint(16, 64))]
        n = N_CHOICES if i >= WARMUP and args.n4_share and int((i - WARMUP) * args.n4_share) != int(
            (i - WARMUP - 1) * args.n4_share) else 1
        sampling = {"temperature": 0.0 if n == 1 else 1.0, "max_tokens": args.max_tokens,
                    "min_tokens": args.max_tokens, "seed": None if n == 1 else 1000 + i}
        out.append({"request_id": i, "arrival_s": 0.05 * i if i < WARMUP else t, "prompt_tokens": prompt, "n": n,
                    "sampling": sampling, "features": {"source": "workload", "logprobs": 0}})
    return out


def engine_requests(specs: list[dict]) -> tuple[list[dict], dict[int, int]]:
    """The workload lines the engine runs for ``specs`` (an n = 4 request is 4 siblings with
    consecutive ids and seeds seed + i, as the API submits them), and engine id -> spec id."""
    lines, group_of = [], {}
    for spec in specs:
        for choice in range(spec["n"]):
            request_id = len(lines)
            seed = spec["sampling"]["seed"]
            sampling = {**spec["sampling"], "seed": None if seed is None else seed + choice}
            features = {**spec["features"], "n": spec["n"], "choice": choice}
            lines.append({"request_id": request_id, "arrival_s": spec["arrival_s"],
                          "prompt_tokens": spec["prompt_tokens"], "sampling": sampling, "features": features})
            group_of[request_id] = spec["request_id"]
    return lines, group_of


def client_loop():
    """uvloop for the clients when it is installed (as for the server): 64 streams' reads on the
    same cores as the engine cost less CPU, and a connection opens in less time."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def load() -> str:
    """The 1-minute load average: other processes on these cores bend both sides' numbers."""
    return f"{os.getloadavg()[0]:.2f}"


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def frontend_cpu_s(engine_pid: int) -> float:
    """CPU seconds so far of the engine's API frontend process (0 when it has none: thread mode)."""
    for task in Path(f"/proc/{engine_pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                if b"engine.api.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
                    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except FileNotFoundError:
                continue
    return 0.0


def serve(run_dir: Path, args, *extra: str) -> subprocess.Popen:
    num_requests = args.clients + WARMUP + (N_CHOICES - 1) * int(args.clients * args.n4_share + 1)
    command = [sys.executable, "-m", "engine", "serve", "--model", "tiny", "--run-dir", str(run_dir),
               "--ssm-slots", str(max(64, num_requests)), "--kv-blocks", "2048", *extra]
    log = open(run_dir / "serve.log", "w")
    return subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def one_client(url: str, spec: dict, t0: float, out: dict) -> None:
    """One streaming completion over its own loopback connection.

    TTFT stops at the first ``data:`` bytes of the response (the server's first token has
    arrived); the events are parsed once the stream has ended, so the client's own parsing
    is not part of the server's latency.
    """
    host, port = url.removeprefix("http://").split(":")
    await asyncio.sleep(max(0.0, t0 + spec["arrival_s"] - time.perf_counter()))
    sent = time.perf_counter()
    body = json.dumps({"model": "tiny", "prompt": spec["prompt_tokens"], "stream": True, "logprobs": 0,
                       "n": spec["n"], "stream_options": {"include_usage": True}, **spec["sampling"]}).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    connected = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
    received, first = bytearray(), None
    while chunk := await reader.read(65536):
        received += chunk
        if first is None and b"data: " in received:
            first = time.perf_counter()
    done = time.perf_counter()
    writer.close()
    head, _, payload = bytes(received).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"request {spec['request_id']}: {head.splitlines()[0].decode()}")
    events = [line[6:] for line in _dechunk(payload).split(b"\n") if line.startswith(b"data: {")]
    usage = json.loads(events[-1])["usage"]
    out[spec["request_id"]] = {"sent": sent, "connect": connected - sent, "ttft": first - sent, "done": done,
                               "tokens": usage["completion_tokens"]}


def _dechunk(payload: bytes) -> bytes:
    """The body of a ``Transfer-Encoding: chunked`` response."""
    body, at = bytearray(), 0
    while True:
        end = payload.index(b"\r\n", at)
        size = int(payload[at:end], 16)
        if size == 0:
            return bytes(body)
        body += payload[end + 2:end + 2 + size]
        at = end + 2 + size + 2


async def drive_api(url: str, specs: list[dict]) -> dict:
    out: dict = {}
    t0 = time.perf_counter()
    await asyncio.gather(*(one_client(url, spec, t0, out) for spec in specs))
    return out


def api_side(args, specs: list[dict], run_dir: Path, *mode: str) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(run_dir, args, "--workload", "none", "--api-port", str(port), *mode)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"the API server did not come up; see {run_dir / 'serve.log'}")
            time.sleep(0.2)
        cpu_before, client_before = children_cpu_s(), time.process_time()
        with asyncio.Runner(loop_factory=client_loop()) as runner:
            results = runner.run(drive_api(url, specs))
        client_cpu = time.process_time() - client_before
        frontend_cpu = frontend_cpu_s(proc.pid)   # its whole life, as the engine's total below
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    measured = [results[s["request_id"]] for s in specs[WARMUP:]]
    span = max(r["done"] for r in measured) - min(r["sent"] for r in measured)
    return {"tokens_s": sum(r["tokens"] for r in measured) / span,
            "ttft_p50_ms": statistics.median(r["ttft"] for r in measured) * 1e3, "span_s": span,
            "engine_cpu_s": children_cpu_s() - cpu_before - frontend_cpu, "frontend_cpu_s": frontend_cpu,
            "client_cpu_s": client_cpu}


def in_process_side(args, specs: list[dict], run_dir: Path) -> dict:
    workload = run_dir / "workload.jsonl"
    lines, group_of = engine_requests(specs)
    workload.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cpu_before = children_cpu_s()
    proc = serve(run_dir, args, "--workload", f"bundle:{workload}")
    if proc.wait(timeout=600) != 0:
        raise SystemExit(f"the in-process run failed; see {run_dir / 'serve.log'}")
    conn = sqlite3.connect(f"file:{run_dir / 'telemetry.db'}?mode=ro", uri=True)
    origin = conn.execute("SELECT arrival_ns FROM requests WHERE request_id = 0").fetchone()[0]
    rows = conn.execute("SELECT request_id, first_token_ns, finished_ns, output_len FROM requests "
                        "WHERE status = 'finished'").fetchall()
    conn.close()
    groups: dict[int, list] = {}
    for request_id, first, finished, output_len in rows:
        if group_of[request_id] >= WARMUP:
            groups.setdefault(group_of[request_id], []).append((first, finished, output_len))
    expected = sum(s["n"] for s in specs[WARMUP:])
    if sum(len(g) for g in groups.values()) != expected:
        raise SystemExit(f"in-process run finished {sum(len(g) for g in groups.values())} of {expected} requests")
    # Time from when each request was due (the feed submits it at the next tick boundary after
    # that, as the API's inbox does), like the client's clock starts when it sends; an n = 4
    # request's first token is its first choice's, as the client sees it.
    due = {s["request_id"]: origin + s["arrival_s"] * 1e9 for s in specs}
    span = (max(f for g in groups.values() for _, f, _ in g) - min(due[k] for k in groups)) / 1e9
    return {"tokens_s": sum(o for g in groups.values() for _, _, o in g) / span,
            "ttft_p50_ms": statistics.median((min(t for t, _, _ in g) - due[k]) / 1e6 for k, g in groups.items()),
            "span_s": span, "engine_cpu_s": children_cpu_s() - cpu_before, "frontend_cpu_s": 0.0,
            "client_cpu_s": 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (requests)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--rate", type=float, default=24.0,
                        help="arrival rate, requests/s (the default keeps the tiny engine out of a growing "
                             "queue on 2 cores, so TTFT measures the path, not the backlog)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per side (medians are printed)")
    parser.add_argument("--n4-share", type=float, default=0.25,
                        help="share of the requests that ask for n = 4 choices (0: all n = 1)")
    parser.add_argument("--thread-side", action="store_true",
                        help="also run the API with --no-api-process (the HTTP server as a thread of the engine)")
    args = parser.parse_args()
    if not 1 <= args.clients <= 256:
        parser.error("--clients must be in [1, 256]")
    if not 0.0 <= args.n4_share <= 1.0:
        parser.error("--n4-share must be in [0, 1]")
    specs = arrivals(args)
    print(f"# bench/api.py on {cpu_model()} ({os.cpu_count()} CPUs, load average {load()} at start): "
          f"{args.clients} streaming clients ({sum(s['n'] > 1 for s in specs)} of them n = {N_CHOICES}), "
          f"{args.max_tokens} tokens per choice, arrivals at {args.rate}/s, tiny model")
    runs = [("in-process", in_process_side), ("API (process)", api_side)]
    if args.thread_side:
        runs.append(("API (thread)", lambda *a: api_side(*a, "--no-api-process")))
    sides: dict[str, list[dict]] = {name: [] for name, _ in runs}
    with tempfile.TemporaryDirectory(prefix="bench-api-") as tmp:
        for round_ in range(args.rounds):   # interleaved: the neighbours' load hits both sides alike
            for index, (name, run_side) in enumerate(runs):
                run_dir = Path(tmp) / f"side{index}-{round_}"
                run_dir.mkdir()
                side = run_side(args, specs, run_dir)
                sides[name].append(side)
                print(f"round {round_ + 1} {name:<13} {side['tokens_s']:>8.1f} out tok/s  TTFT p50 "
                      f"{side['ttft_p50_ms']:>8.2f} ms  (load average {load()})", flush=True)
    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in sides.items()}
    inproc, api = med["in-process"], med["API (process)"]
    ratio = api["tokens_s"] / inproc["tokens_s"]
    added = api["ttft_p50_ms"] - inproc["ttft_p50_ms"]
    print(f"medians of {args.rounds} interleaved rounds (load average {load()} at the end)")
    print(f"{'side':<13} {'out tok/s':>10} {'TTFT p50 ms':>12} {'span s':>8} {'engine CPU s':>13} "
          f"{'frontend CPU s':>15} {'client CPU s':>13}")
    for name, side in med.items():
        print(f"{name:<13} {side['tokens_s']:>10.1f} {side['ttft_p50_ms']:>12.2f} {side['span_s']:>8.2f} "
              f"{side['engine_cpu_s']:>13.2f} {side['frontend_cpu_s']:>15.2f} {side['client_cpu_s']:>13.2f}")
    if "API (thread)" in med:
        thread = med["API (thread)"]
        print(f"API as a thread of the engine (--no-api-process): ratio {thread['tokens_s'] / inproc['tokens_s']:.3f}, "
              f"added TTFT p50 {thread['ttft_p50_ms'] - inproc['ttft_p50_ms']:.2f} ms")
    print(f"throughput ratio API / in-process = {ratio:.3f} (target >= 0.9): {'PASS' if ratio >= 0.9 else 'FAIL'}")
    print(f"added TTFT p50 = {added:.2f} ms (target <= 5 ms): {'PASS' if added <= 5.0 else 'FAIL'}")
    cpu_ratio = inproc["engine_cpu_s"] / api["engine_cpu_s"]
    print(f"output tokens per engine CPU-second, API / in-process = {cpu_ratio:.3f} "
          f"(what the API costs the tick loop's process; the frontend's own CPU is its column; wall-clock "
          f"ratios on a CPU-starved machine also pay the frontend's and the client's CPU)")
    return 0 if ratio >= 0.9 and added <= 5.0 else 1


if __name__ == "__main__":
    sys.exit(main())
