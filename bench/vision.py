"""Images on a vision checkpoint: what the encoder cache buys on a repeated image, and the encoder's share.

The same image-and-question request runs ``--repeats`` times through the real scheduler, one at a
time, with the prefix cache off (so only the encoder cache can help), in two configurations,
interleaved round by round (the order flips every round, so drift in the machine's load hits both):

- ``cache``: the encoder cache as the engine runs it: the first request runs the tower, the rest hit;
- ``no_cache``: the cache emptied before every request, so every request runs the tower.

Prints the CPU model and dtype, the TTFT p50 of requests 2.. per configuration and their ratio,
and the encoder's share of prefill time (the tower's time over the chunk forwards' time, from the
chunk rows' ``encoder_ns`` and ``duration_ns``) in the no-cache configuration.

    python bench/vision.py [--model tiny-vl] [--image-size 256] [--repeats 6] [--rounds 3] [--dtype auto]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

# Run as a script, bench/ comes first on sys.path and bench/telemetry.py would shadow the
# telemetry package; the repo root (or the installed package) is what is meant.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from engine.model.cpu_features import cpu_model, resolve_dtype  # noqa: E402
from engine.model.embedded import checkpoint_dir_of  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model.runner import ModelRunner  # noqa: E402
from engine.multimodal.request_images import RequestImages  # noqa: E402
from engine.multimodal.seeded_image import seeded_png  # noqa: E402
from engine.scheduler.loop import Scheduler  # noqa: E402
from engine.scheduler.request_features import RequestFeatures  # noqa: E402
from engine.serve.driver import TickDriver  # noqa: E402
from telemetry import events as ev  # noqa: E402
from telemetry.levers import defaults  # noqa: E402

CONFIGS = ("cache", "no_cache")


def run_config(model, directory: Path, data: bytes, repeats: int, keep_cache: bool) -> tuple[list[float], int, int]:
    """(TTFT seconds of each request, the tower's ns, the chunk forwards' ns) for ``repeats`` requests."""
    rows: list = []
    runner = ModelRunner.build(model, num_kv_blocks=256, num_ssm_slots=2, dtype=next(model.parameters()).dtype)
    images = RequestImages.for_model(model, directory)
    sched = Scheduler(runner, defaults(), emit=rows.append, prefix_cache=False, images=images)
    prompt = images.placeholders(data) + list(b"What is in this picture?")
    key = images.store.put(data)
    ttft = []
    for i in range(repeats):
        if not keep_cache:
            runner.encoder_cache.entries.clear()
        request = sched.submit(i, prompt, {"max_tokens": 1}, features=RequestFeatures(images=(key,)))
        TickDriver(sched).run()
        if request.error is not None:
            raise SystemExit(f"request {i} failed: {request.error}")
        ttft.append((request.first_token_ns - request.arrival_ns) / 1e9)
    chunks = [r for r in rows if isinstance(r, ev.ChunkDecision)]
    return ttft, sum(c.encoder_ns or 0 for c in chunks), sum(c.duration_ns for c in chunks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-vl", help="a checkpoint with a vision tower (default tiny-vl)")
    parser.add_argument("--image-size", type=int, default=256, help="image side in pixels before resizing")
    parser.add_argument("--repeats", type=int, default=6, help="requests per configuration and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    dtype = getattr(torch, resolve_dtype(args.dtype))
    directory = checkpoint_dir_of(args.model)
    model, _, _ = load_model(directory, dtype=dtype)
    if model.visual is None:
        raise SystemExit(f"--model {args.model}: no vision tower")
    data = seeded_png(args.image_size, args.image_size, 0)
    tokens = RequestImages.for_model(model, directory).prepare(data).num_tokens
    print(f"CPU: {cpu_model()} | dtype: {str(dtype).removeprefix('torch.')} | threads: {args.threads}")
    print(f"model {args.model}: image {args.image_size}x{args.image_size} px -> {tokens} placeholder tokens; "
          f"{args.repeats} requests x {args.rounds} rounds per configuration, prefix cache off")
    later: dict[str, list[float]] = {name: [] for name in CONFIGS}
    encoder_ns = forward_ns = 0
    for round_index in tqdm(range(args.rounds), desc="rounds"):
        order = CONFIGS if round_index % 2 == 0 else CONFIGS[::-1]
        for name in order:
            ttft, tower, chunks = run_config(model, directory, data, args.repeats, keep_cache=name == "cache")
            later[name] += ttft[1:]   # request 1 runs the tower in both
            if name == "no_cache":
                encoder_ns, forward_ns = encoder_ns + tower, forward_ns + chunks
    p50 = {name: statistics.median(values) for name, values in later.items()}
    for name in CONFIGS:
        print(f"{name:<9} TTFT p50, requests 2..{args.repeats}: {p50[name] * 1e3:8.2f} ms")
    print(f"TTFT p50 ratio cache / no_cache: {p50['cache'] / p50['no_cache']:.3f}")
    print(f"encoder share of prefill time (no_cache): {encoder_ns / forward_ns:.3f} "
          f"({encoder_ns / 1e6:.1f} ms of {forward_ns / 1e6:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
