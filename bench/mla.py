"""MLA on the Kimi Linear family: decode speed, the absorbed form, and latent vs per-head KV bytes.

Prints, side by side in one run (CPU model, dtype, threads and load average first):

1. decode tokens/s of ``tiny-kimi`` through our runner vs transformers' KimiLinearForCausalLM
   on the same weights, at batch 1, 8 and 32 over a ``--context``-token cache (median of the
   rounds, ours and theirs interleaved; transformers runs its pure-torch KDA fallback here,
   as ``fla`` is not installed);
2. one MLA layer's decode attention in the absorbed form (W_UK folded into the query, W_UV
   after the softmax: what the engine runs) vs the expanded form (every cached latent
   up-projected to per-head K/V each step), for tiny-kimi's layer and a Kimi-Linear-48B-shaped
   one (32 heads, kv_lora_rank 512, rope 64, nope 128, v 128), batch 8;
3. latent vs per-head KV bytes per token, for both shapes;
4. TTFT p50 of long prompts arriving during decode with ``mla_chunked_prefill`` off (the
   reference's whole-prompt rule: decode waits behind the whole prefill) vs on (``ttft_section``).

    python bench/mla.py [--rounds 3] [--steps 8] [--context 64] [--threads 1] [--dtype auto] [--no-hf] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.cache.latent_store import LatentKVStore  # noqa: E402
from engine.cache.sequence import SequenceState  # noqa: E402
from engine.model.batch import build_batch  # noqa: E402
from engine.model.cpu_features import cpu_model, resolve_dtype  # noqa: E402
from engine.model.embedded import checkpoint_dir_of  # noqa: E402
from engine.model.kimi_config import KimiConfig  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model.mla import LatentAttention  # noqa: E402
from engine.model.runner import ModelRunner  # noqa: E402
from engine.scheduler.loop import Scheduler  # noqa: E402
from telemetry import events as ev  # noqa: E402
from telemetry.levers import defaults  # noqa: E402

BATCHES = (1, 8, 32)
# One MLA layer of Kimi-Linear-48B-A3B (transformers' KimiLinearConfig defaults).
KIMI_48B_MLA = KimiConfig(vocab_size=163840, hidden_size=2304, intermediate_size=9216, num_hidden_layers=1,
                          num_attention_heads=32, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                          v_head_dim=128, linear_num_heads=32, linear_head_dim=128,
                          layer_types=("full_attention",), mlp_layer_types=("dense",))


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Ours:
    def __init__(self, model, context: int, max_steps: int, dtype: torch.dtype):
        blocks = -(-(context + max_steps + 1) // 16) + 1
        self.runner = ModelRunner.build(model, num_kv_blocks=max(BATCHES) * blocks, num_ssm_slots=max(BATCHES), dtype=dtype)
        self.seqs = []
        for i in range(max(BATCHES)):
            seq = SequenceState(i)
            self.runner.pools.admit(seq)
            self.runner.prefill_chunk(seq, [(7 * i + t) % 256 for t in range(context)], 0, context, True)
            self.seqs.append(seq)

    def decode_step(self, batch: int) -> float:
        return seconds(lambda: self.runner.decode(self.seqs[:batch], [1] * batch))


class Theirs:
    """transformers' KimiLinearForCausalLM from the tiny-kimi checkpoint; one growing cache per batch size."""

    def __init__(self, context: int, dtype: torch.dtype):
        import transformers
        self.hf = transformers.KimiLinearForCausalLM.from_pretrained(checkpoint_dir_of("tiny-kimi"), dtype=dtype).eval()
        self.caches = {}
        with torch.inference_mode():
            for batch in BATCHES:
                ids = torch.tensor([[(7 * i + t) % 256 for t in range(context)] for i in range(batch)])
                self.caches[batch] = self.hf(ids, use_cache=True).past_key_values

    @torch.inference_mode()
    def decode_step(self, batch: int) -> float:
        token = torch.ones(batch, 1, dtype=torch.long)
        return seconds(lambda: self.hf(token, cache=self.caches[batch], use_cache=True))


def decode_section(args, dtype: torch.dtype) -> list[dict]:
    model = load_model("tiny-kimi", dtype=dtype)[0]
    ours = Ours(model, args.context, args.rounds * args.steps, dtype)
    theirs = None if args.no_hf else Theirs(args.context, dtype)
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for batch in BATCHES:
                for side, runner in (("ours", ours), ("theirs", theirs)):
                    if runner is not None:
                        steps = [runner.decode_step(batch) for _ in range(args.steps)]
                        times.setdefault((side, batch), []).append(statistics.median(steps))
    rows = []
    for batch in BATCHES:
        row = {"batch": batch, "ours_tok_s": batch / statistics.median(times[("ours", batch)])}
        if theirs is not None:
            row["theirs_tok_s"] = batch / statistics.median(times[("theirs", batch)])
            row["ratio"] = row["ours_tok_s"] / row["theirs_tok_s"]
        rows.append(row)
    return rows


def mla_layer(config: KimiConfig, dtype: torch.dtype) -> LatentAttention:
    torch.manual_seed(0)
    layer = LatentAttention(config, 0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape) * 0.02 + (param.dim() == 1))
    layer.to(dtype).eval()
    layer.fuse()
    return layer


def absorb_section(args, dtype: torch.dtype) -> list[dict]:
    shapes = {"tiny-kimi": load_model("tiny-kimi")[1], "kimi-48b": KIMI_48B_MLA}
    rows = []
    for name, config in shapes.items():
        layer = mla_layer(config, dtype)
        for context in (256, 1024):
            batch_size, blocks = 8, -(-(context + 1) // 16)
            store = LatentKVStore([0], batch_size * blocks, 16, config.latent_dim, dtype=dtype)
            for layer_store in store.latents.values():
                layer_store.normal_()
            tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch_size)]
            batch = build_batch(None, [(1, context, tables[i], 0) for i in range(batch_size)], 16)
            q = torch.randn(batch_size, config.num_attention_heads, config.qk_head_dim, dtype=dtype)
            timed = {"absorbed": [], "expanded": []}
            with torch.inference_mode():
                layer.absorbed_decode(q, batch, store), layer.expanded_decode(q, batch, store)  # warm-up, untimed
                for _ in range(args.rounds):
                    timed["absorbed"].append(seconds(lambda: layer.absorbed_decode(q, batch, store)))
                    timed["expanded"].append(seconds(lambda: layer.expanded_decode(q, batch, store)))
            absorbed, expanded = (statistics.median(timed[k]) * 1e3 for k in ("absorbed", "expanded"))
            rows.append({"shape": name, "context": context, "batch": batch_size, "absorbed_ms": absorbed,
                         "expanded_ms": expanded, "speedup": expanded / absorbed})
    return rows


def bytes_section(dtype: torch.dtype) -> list[dict]:
    rows = []
    for name, config in (("tiny-kimi", load_model("tiny-kimi")[1]), ("kimi-48b", KIMI_48B_MLA)):
        latent = config.latent_dim * dtype.itemsize
        full = config.full_kv_width * dtype.itemsize
        rows.append({"shape": name, "latent_bytes_per_token_layer": latent, "full_bytes_per_token_layer": full,
                     "ratio": full / latent})
    return rows


def serve_long_prompts(model, dtype: torch.dtype, chunked: bool, args) -> dict:
    """4 decoding requests, then ``--arrivals`` prompts (long and short in turn) arriving every
    ``--gap-ms`` by the wall clock while they decode; the real scheduler, ``mla_chunked_prefill`` as given."""
    rows: list = []
    runner = ModelRunner.build(model, num_kv_blocks=1024, num_ssm_slots=16, dtype=dtype)
    levers = defaults().replace(mla_chunked_prefill=chunked, max_prefill_tokens=args.chunk, max_tick_tokens=1 << 16)
    sched = Scheduler(runner, levers, emit=rows.append)
    rng = random.Random(0)
    for i in range(4):
        # They decode through the whole run (2,000 tokens fit the cache beside every arrival).
        sched.submit(i, [rng.randrange(256) for _ in range(16)], {"max_tokens": 2000, "min_tokens": 2000})
    while len(sched.active) < 4:
        if not sched.step():
            raise RuntimeError(f"the decoders did not start: {[r.error for r in sched.done]}")
    arrivals = [(100 + i, args.long if i % 2 == 0 else 32) for i in range(args.arrivals)]
    start, arrived, ended = time.perf_counter(), {}, 0
    while ended < len(arrivals):
        due = int((time.perf_counter() - start) * 1e3 // args.gap_ms) + 1
        for request_id, length in arrivals[len(arrived):due]:
            arrived[request_id] = length
            sched.submit(request_id, [rng.randrange(256) for _ in range(length)], {"max_tokens": 4, "min_tokens": 4})
        sched.step()
        ended = sum(1 for r in sched.done if r.request_id >= 100)
    sched.stop()
    done = {r.request_id: r for r in sched.done}
    ttft = {length: [(done[i].first_token_ns - done[i].arrival_ns) / 1e6 for i, n in arrived.items() if n == length]
            for length in set(arrived.values())}
    # The decoders' inter-token gaps: what a whole-prompt prefill makes them wait.
    last, gaps = {}, []
    for row in rows:
        if isinstance(row, ev.TokenEvent) and row.request_id < 4:
            if row.request_id in last:
                gaps.append((row.t_ns - last[row.request_id]) / 1e6)
            last[row.request_id] = row.t_ns
    gaps.sort()
    return {"ttft_p50_ms": {str(n): statistics.median(v) for n, v in sorted(ttft.items())},
            "itl_p99_ms": gaps[int(0.99 * (len(gaps) - 1))], "itl_max_ms": gaps[-1]}


def ttft_section(args, dtype: torch.dtype) -> dict:
    model = load_model("tiny-kimi", dtype=dtype)[0]
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with torch.inference_mode():
        for _ in range(args.rounds):  # interleaved: both rules see the same machine load
            for name, chunked in (("off", False), ("on", True)):
                runs[name].append(serve_long_prompts(model, dtype, chunked, args))

    def med(name, key, sub=None):
        return statistics.median(r[key][sub] if sub else r[key] for r in runs[name])

    lengths = list(runs["off"][0]["ttft_p50_ms"])
    return {name: {"ttft_p50_ms": {n: med(name, "ttft_p50_ms", n) for n in lengths},
                   "itl_p99_ms": med(name, "itl_p99_ms"), "itl_max_ms": med(name, "itl_max_ms")}
            for name in runs}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--long", type=int, default=768, help="tokens of each long arriving prompt")
    parser.add_argument("--chunk", type=int, default=64, help="max_prefill_tokens with mla_chunked_prefill on")
    parser.add_argument("--arrivals", type=int, default=6, help="prompts arriving during decode (long, short, ...)")
    parser.add_argument("--gap-ms", type=float, default=400.0, help="ms between arrivals")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype_name = resolve_dtype(args.dtype)
    dtype = getattr(torch, dtype_name)
    result = {"cpu": cpu_model(), "dtype": dtype_name, "threads": args.threads, "load": os.getloadavg()[0],
              "decode": decode_section(args, dtype), "absorbed_vs_expanded": absorb_section(args, dtype),
              "kv_bytes": bytes_section(dtype), "long_prompts": ttft_section(args, dtype)}
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    print(f"CPU {result['cpu']}, dtype {dtype_name}, {args.threads} thread(s), load {result['load']:.2f}")
    print(f"\ndecode tokens/s, tiny-kimi, context {args.context} (median of {args.rounds} rounds x {args.steps} steps)")
    for row in result["decode"]:
        theirs = f"  transformers {row['theirs_tok_s']:9.1f}  ratio {row['ratio']:5.2f}x" if "ratio" in row else ""
        print(f"  b{row['batch']:<3} ours {row['ours_tok_s']:9.1f}{theirs}")
    print("\nMLA decode attention, one layer, batch 8: absorbed (engine) vs expanded (up-project every latent)")
    for row in result["absorbed_vs_expanded"]:
        print(f"  {row['shape']:<10} context {row['context']:5}  absorbed {row['absorbed_ms']:8.3f} ms  "
              f"expanded {row['expanded_ms']:8.3f} ms  {row['speedup']:5.1f}x")
    print("\nKV bytes per token and MLA layer")
    for row in result["kv_bytes"]:
        print(f"  {row['shape']:<10} latent {row['latent_bytes_per_token_layer']:6}  per-head K/V "
              f"{row['full_bytes_per_token_layer']:6}  {row['ratio']:5.1f}x smaller")
    print(f"\nprompts arriving during 4 decodes (every {args.gap_ms:.0f} ms, {args.long} and 32 tokens in turn), "
          f"median of {args.rounds} runs")
    for name, label in (("off", "mla_chunked_prefill off (whole prompt)"),
                        ("on", f"mla_chunked_prefill on ({args.chunk}-token chunks)")):
        row = result["long_prompts"][name]
        ttft = "  ".join(f"TTFT p50 {n}-token {v:7.1f} ms" for n, v in row["ttft_p50_ms"].items())
        print(f"  {label:<40} {ttft}  decode ITL p99 {row['itl_p99_ms']:6.1f} ms  max {row['itl_max_ms']:6.1f} ms")
    return result


if __name__ == "__main__":
    main()
