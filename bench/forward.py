"""Forward speed: Chunkscope's runner vs transformers' Qwen3_5ForCausalLM on the same weights.

Prints, for the ``tiny`` default and a SmolLM-sized random Qwen3.5 (hidden 576, 30 layers,
3:1 linear/full), a 512-token prefill and decode steps at batch 1, 8 and 32: our time, the
transformers time and their ratio, and each forward's **roofline** (``engine/model/roofline.py``):
max(its FLOPs at the square-GEMM rate, its weight + KV + linear-state bytes at the streaming
read bandwidth), both measured in the same run with the same threads (the GEMM in the run's dtype,
the fastest of MKL's and oneDNN's: ``roofline.square_gemms``), and the
share of that roofline each side reaches (roofline time / measured time; 100% is the machine's
limit). Decode rows also time the step's GEMMs alone (every projection and the LM head, as
the engine runs them, on random inputs): the share those reach bounds any forward built on
the same GEMM kernels. ``--json`` prints the same as one object on stdout.

The machine is shared, so every measurement is interleaved, and both sides get identical
conditions. Each round, per forward kind, runs one **block** per side, ours then transformers',
and each block starts right after a probe of the machine rates (one square GEMM, one read pass:
``RateProbe``), which also evicts both models' working sets from the caches. A decode block is
``1 + --steps`` consecutive steps, as a serving loop runs decode (tick after tick): its first
step, right after the probe, is the **cold** step (caches, TLB and branch predictors full of the
probe's data; printed and in the JSON as ``ours_cold_ms`` / ``theirs_cold_ms`` / ``ratio_cold``),
and the ``--steps`` steps after it are the **steady** state that ``ours_ms`` / ``theirs_ms`` /
``ratio`` report. A prefill block is one prefill (the cold case is what a prefill sees). Times
and ratios are medians over the rounds. Each row's roofline share takes the same statistic on
both sides: the best of the probes taken before that row's blocks (the highest rates the machine
showed then, so the bar is never lowered) against the best steady forward (``roofline_share``;
``roofline_share_cold`` against the best cold one); the median-against-median share and the
spread of both are printed beside it, so one noisy probe (read bandwidth moved 10.5 -> 15.4 GB/s
between two runs a minute apart) cannot move the share by itself.

    python bench/forward.py [--models tiny,smol] [--rounds 3] [--steps 4] [--threads 1]
                            [--dtype native|auto|float32|bfloat16[,...]] [--isa auto|avx2|avx512[,...]] [--no-hf]
                            [--clock wall|cpu] [--no-prepack] [--no-decode-prepack] [--compile off|on] [--json]

Rows per **ISA and dtype**: ``--isa`` lists the native-kernel variants to run (engine/kernels/native.py;
``auto`` is the one this CPU gets; ``avx2,avx512`` on an AVX-512 machine adds the forced-AVX2 row),
``--dtype`` the dtypes (``float32,bfloat16``); every combination is a block of rows, tagged ``isa``
and ``dtype`` in the JSON. The default, ``native``, is fp32 and, where the CPU multiplies bf16
natively (AMX or AVX512-BF16, where ``auto`` picks bf16), bf16 too: a figure from a bf16 machine
is then never only the bf16 one (issue 26: tiny decode b32 was 1.03x transformers in bf16 on a
Xeon against 3.59x in fp32 on an EPYC). The first line printed names the CPU model, its ISA flags,
the dtype ``auto`` resolves to here and the dtypes chosen; every block's header names its dtype.

``--compile on`` runs our decode rows through the engine's compiled decode step (inductor on CPU,
``engine/model/compiled_decode.py``), compiled before the first round (the time is printed and goes
in the JSON as ``compile_s``; inductor's cache under the chunkscope cache dir makes a rerun fast).
"""
from __future__ import annotations

import argparse
import builtins
import collections
import functools
import json
import os
import statistics
import sys
import time

# The repository root first (as a script, bench/ leads sys.path): bench.forward_report resolves either way.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.kernels import native  # noqa: E402
from engine.model.compiled_decode import CompileSettings, bucket_for, resolve_compile, use_persistent_cache  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402
from engine.model.cpu_features import cpu_flags, cpu_model, default_dtype, isa_summary, resolve_dtype  # noqa: E402
from engine.model.layers import FusedLinear  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model.qwen3_5 import Qwen35ForCausalLM  # noqa: E402
from engine.model.roofline import ForwardCost, MachineRates, RateProbe, forward_cost  # noqa: E402
from engine.model.runner import ModelRunner  # noqa: E402
from engine.model.tiny import cache_root, random_init  # noqa: E402
from engine.cache.sequence import SequenceState  # noqa: E402

from bench.forward_report import result_row, row_text  # noqa: E402

SMOL = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                   linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                   linear_value_head_dim=64, tie_word_embeddings=True)
PROMPT_LEN, DECODE_CONTEXT, BATCHES = 512, 32, (1, 8, 32)


def build(name: str, dtype: torch.dtype) -> Qwen35ForCausalLM:
    if name == "tiny":
        return load_model("tiny", dtype=dtype)[0]
    model = Qwen35ForCausalLM(SMOL)
    random_init(model, seed=0)
    model.to(dtype).eval()
    model.fuse()
    return model


# perf_counter (wall) or thread_time (CPU seconds of this thread: with --threads 1 all the work runs
# here, and time spent descheduled on a shared machine is not counted against either side).
CLOCK = time.perf_counter


def seconds(fn) -> float:
    start = CLOCK()
    fn()
    return CLOCK() - start


class Ours:
    """Our runner: a prefill on a fresh runner, and decode over sequences prefilled once."""

    def __init__(self, model: Qwen35ForCausalLM, max_steps: int, compile: CompileSettings | None = None):
        self.model = model
        self.dtype = next(model.parameters()).dtype
        blocks_per_seq = -(-(DECODE_CONTEXT + max_steps) // 16) + 1
        self.runner = ModelRunner.build(model, num_kv_blocks=max(BATCHES) * blocks_per_seq, num_ssm_slots=max(BATCHES),
                                        dtype=self.dtype, compile=compile)
        self.seqs = []
        for i in range(max(BATCHES)):
            seq = SequenceState(i)
            self.runner.pools.admit(seq)
            self.runner.prefill_chunk(seq, list(range(1, DECODE_CONTEXT + 1)), 0, DECODE_CONTEXT, True)
            self.seqs.append(seq)

    def prefill(self, prompt: list[int]) -> float:
        runner = ModelRunner.build(self.model, num_kv_blocks=-(-len(prompt) // 16) + 1, num_ssm_slots=1,
                                   dtype=self.dtype)
        seq = SequenceState(0)
        runner.pools.admit(seq)
        return seconds(lambda: runner.prefill_chunk(seq, prompt, 0, len(prompt), True))

    def decode_step(self, batch: int) -> float:
        return seconds(lambda: self.runner.decode(self.seqs[:batch], [1] * batch))

    def compile_decode(self) -> float:
        """Compile the decode step for every batch size the rounds use (padding rows only); seconds."""
        step = self.runner.compiled_decode
        started = time.perf_counter()
        for batch in BATCHES:
            step([], bucket=bucket_for(batch, step.settings.buckets))
        return time.perf_counter() - started


class Theirs:
    """transformers' Qwen3_5ForCausalLM with the same weights; one growing cache per batch size."""

    def __init__(self, model: Qwen35ForCausalLM):
        import transformers
        cfg = model.config.to_hf_dict()
        for key in ("model_type", "architectures", "dtype"):
            cfg.pop(key)
        hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**cfg)).eval()
        hf.load_state_dict({k: v.float() for k, v in model.state_dict().items()}, strict=False)
        self.hf = hf.to(next(model.parameters()).dtype)
        self.caches, self.positions = {}, {}
        with torch.inference_mode():
            for batch in BATCHES:
                out = self.hf(torch.arange(1, DECODE_CONTEXT + 1).repeat(batch, 1), use_cache=True)
                self.caches[batch] = out.past_key_values
                self.positions[batch] = DECODE_CONTEXT

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> float:
        ids = torch.tensor([prompt])
        return seconds(lambda: self.hf(ids, use_cache=True))

    @torch.inference_mode()
    def decode_step(self, batch: int) -> float:
        position = torch.full((batch, 1), self.positions[batch], dtype=torch.long)
        token = torch.ones(batch, 1, dtype=torch.long)
        self.positions[batch] += 1
        return seconds(lambda: self.hf(token, cache=self.caches[batch], use_cache=True, position_ids=position))


def decode_cost(model: Qwen35ForCausalLM, batch: int, context: int, weight_bytes: int) -> ForwardCost:
    return forward_cost(model.config, weight_bytes, 0, 0, [context] * batch, batch)


def decode_linears(model: Qwen35ForCausalLM) -> list[FusedLinear]:
    """Every GEMM a decode step runs, in forward order, as the engine runs it (packed where it packs)."""
    found = []
    for layer in model.model.layers:
        mixer = layer.linear_attn if layer.is_linear else layer.self_attn
        found += [mixer.fused_in, mixer.fused_out] if layer.is_linear else [mixer.fused_qkv, mixer.fused_o]
        mlp = layer.mlp
        # Decode rows run gate and up as one skinny GEMM where the kernel is built, else the packed halves.
        halves = mlp.packed_gate is not None and not mlp.fused_gate_up.skinny
        found += [mlp.packed_gate, mlp.packed_up] if halves else [mlp.fused_gate_up]
        found.append(mlp.fused_down)
    return found + [model.fused_lm_head]


def gemm_floor_seconds(linears: list[FusedLinear], batch: int, dtype: torch.dtype) -> float:
    """One pass of a decode step's GEMMs alone (no norms, no mixers): what the GEMM kernels cost by themselves.

    The weights together are larger than the caches, so each is read from memory as in a real step.
    """
    inputs = [torch.randn(batch, linear.weight.shape[1], dtype=dtype) for linear in linears]
    return seconds(lambda: [linear(x) for linear, x in zip(linears, inputs)])


def bench_model(name: str, dtype: torch.dtype, rounds: int, steps: int, with_hf: bool,
                compile: CompileSettings | None = None) -> list[dict]:
    """Interleaved rounds of probe + our block / probe + their block per forward kind; one result row per kind."""
    model = build(name, dtype)
    weight_bytes = torch.finfo(dtype).bits // 8
    prompt = [(i * 37) % model.config.vocab_size for i in range(PROMPT_LEN)]
    ours = Ours(model, 1 + len(BATCHES) * rounds * (1 + steps), compile)
    theirs = Theirs(model) if with_hf else None
    compile_s = None
    if ours.runner.compiled_decode is not None:
        compile_s = ours.compile_decode()
        print(f"[{name}] compiled the decode step ({compile.backend}) for batches {BATCHES} in {compile_s:.1f} s wall")
    # Warm-up: first calls allocate and pick kernels.
    ours.decode_step(1)
    if theirs:
        theirs.decode_step(1)
    times: dict[str, list[float]] = {}  # "ours b8" (steady steps), "ours b8 cold", "gemms b8", ...
    rates: dict[str, list[MachineRates]] = {}  # per forward kind: the probes taken before its blocks
    probe = RateProbe(dtype, clock=CLOCK)
    linears = decode_linears(model)

    def block(side: str, key: str, forward, steady_steps: int) -> None:
        """``steps`` probes (the last right before the block: both sides start from the same evicted
        caches), then one cold forward and ``steady_steps`` back-to-back ones."""
        rates.setdefault(key, []).extend(probe.sample() for _ in range(steps))
        times.setdefault(f"{side} {key} cold", []).append(forward())
        times.setdefault(f"{side} {key}", []).extend(forward() for _ in range(steady_steps))

    for _ in range(rounds):
        block("ours", "prefill", lambda: ours.prefill(prompt), 0)
        if theirs:
            block("theirs", "prefill", lambda: theirs.prefill(prompt), 0)
        for batch in BATCHES:
            block("ours", f"b{batch}", lambda: ours.decode_step(batch), steps)
            if theirs:
                block("theirs", f"b{batch}", lambda: theirs.decode_step(batch), steps)
            times.setdefault(f"gemms b{batch}", []).append(gemm_floor_seconds(linears, batch, dtype))
    # A prefill block has no steady part: its one forward is both.
    for side in ("ours", "theirs"):
        if f"{side} prefill cold" in times:
            times[f"{side} prefill"] = times[f"{side} prefill cold"]
    every = [r for samples in rates.values() for r in samples]
    flops = sorted(r.flops_per_s / 1e9 for r in every)
    reads = sorted(r.bytes_per_s / 1e9 for r in every)
    libraries = ", ".join(f"{lib} {n}" for lib, n in sorted(collections.Counter(r.gemm for r in every).items()))
    print(f"[{name}] machine over {len(every)} probes before the blocks: square GEMM best "
          f"{flops[-1]:.1f} GFLOP/s (median {statistics.median(flops):.1f}, min {flops[0]:.1f}; fastest GEMM "
          f"per probe: {libraries}), read best "
          f"{reads[-1]:.1f} GB/s (median {statistics.median(reads):.1f}, min {reads[0]:.1f})")
    # Decode rows sit after DECODE_CONTEXT prompt tokens plus about half the steps taken.
    context = DECODE_CONTEXT + (rounds * (steps + 1)) // 2 + 1
    kinds = [("prefill", 1, "prefill", forward_cost(model.config, weight_bytes, PROMPT_LEN, 0, [], 1))]
    kinds += [("decode", batch, f"b{batch}", decode_cost(model, batch, context, weight_bytes)) for batch in BATCHES]
    rows = [result_row(name, row, batch, key, cost, times, rates[key], compile_s)
            for row, batch, key, cost in kinds]
    for r in rows:
        print(row_text(name, r, PROMPT_LEN))
    return rows


def bench_dtypes(choice: str, flags: set[str]) -> list[str]:
    """The dtypes to run, in order, from ``--dtype``: 'native' is float32 plus bfloat16 where ``flags``
    multiply bf16 natively; anything else a comma list ``resolve_dtype`` checks."""
    if choice == "native":
        return ["float32"] + (["bfloat16"] if default_dtype(flags) == "bfloat16" else [])
    return list(dict.fromkeys(resolve_dtype(item, flags) for item in choice.split(",")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smol")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--steps", type=int, default=4, help="decode steps per batch size per round")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both sides)")
    parser.add_argument("--dtype", default="native",
                        help="comma list of auto, float32, bfloat16 (auto: bfloat16 where the CPU has AMX or "
                             "AVX512-BF16, else float32: the engine's default), or native (the default): "
                             "float32, plus bfloat16 where the CPU multiplies it natively")
    parser.add_argument("--isa", default="auto",
                        help=f"comma list of native-kernel variants: auto (this CPU's), {', '.join(native.VARIANTS)}")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout (the table goes to stderr)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="cpu: thread CPU time (steadier on a loaded machine; meaningful with --threads 1)")
    parser.add_argument("--no-prepack", action="store_true",
                        help="MKL sgemm only: no oneDNN-prepacked prefill GEMMs (the engine prepacks by default; "
                             "CHUNKSCOPE_ONEDNN_PREPACK=0 does the same)")
    parser.add_argument("--no-decode-prepack", action="store_true",
                        help="decode rows through MKL's sgemm, prefill still prepacked (CHUNKSCOPE_DECODE_PREPACK=0)")
    parser.add_argument("--compile", default="off", choices=["off", "on"],
                        help="on: our decode rows through the compiled decode step (inductor on CPU)")
    args = parser.parse_args()
    from engine.model import layers
    if args.no_prepack:
        layers.PREPACK_ENABLED = False
    if args.no_decode_prepack:
        layers.DECODE_PREPACK_ENABLED = False
    for name, value in (("--rounds", args.rounds), ("--steps", args.steps), ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    global print
    if args.json:
        print = functools.partial(builtins.print, file=sys.stderr)
    flags = cpu_flags()
    try:
        dtypes = bench_dtypes(args.dtype, flags)
        isas = [native.variant_name(flags, choice) for choice in args.isa.split(",")]
    except ValueError as error:
        parser.error(str(error))
    if args.compile == "on" and len(isas) > 1:
        parser.error("--compile on takes one --isa per run: the C++ operators load once per process")
    print(f"cpu={cpu_model()} flags=({isa_summary(flags)}) auto dtype={resolve_dtype('auto', flags)} "
          f"threads={torch.get_num_threads()} dtypes={','.join(dtypes)} (--dtype {args.dtype}) "
          f"kernel isas={','.join(isas)} "
          f"rounds={args.rounds} steps={args.steps} clock={args.clock}")
    names = args.models.split(",")
    for name in names:
        if name not in ("tiny", "smol"):
            parser.error(f"--models: unknown model {name!r} (tiny, smol)")
    compile = resolve_compile(args.compile, "cpu")
    if compile is not None:
        use_persistent_cache(cache_root() / "inductor")
    rows = []
    for dtype in dtypes:
        for isa in isas:
            native.ISA = isa
            reason = native.why_unavailable(flags, native.compiler(), isa)
            print(f"--- dtype {dtype}, kernel isa {isa}" + (f" (native kernels unavailable: {reason})" if reason else ""))
            for name in names:
                model_rows = bench_model(name, getattr(torch, dtype), args.rounds, args.steps, not args.no_hf, compile)
                rows += [{**row, "dtype": dtype, "isa": isa} for row in model_rows]
    if args.json:
        builtins.print(json.dumps({"cpu": cpu_model(), "isa": isa_summary(flags), "threads": torch.get_num_threads(),
                                   "auto_dtype": resolve_dtype("auto", flags), "dtype": ",".join(dtypes),
                                   "kernel_isas": isas, "clock": args.clock, "compile": args.compile,
                                   "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
