"""The prepared check for the first machine with a CUDA GPU: one command, one line per check, a verdict.

    python bench/gpu_check.py [--requests 40] [--rounds 20]

Checks, in order (a machine with a GPU runs all of it in a few minutes, well under 8):

1. ``pytest --gpu -m gpu``: the GPU tests (CUDA parity, CUDA streams, stream ordering with a
   lagging prefill stream);
2. parity on CUDA against transformers (its fp32 CPU forward on the same random checkpoint):
   fp32 (logits at the prompt's end and 32 teacher-forced steps within 1e-3, 32 free-running greedy
   tokens equal, TF32 off) and bf16 (logits within 10% of their scale, teacher-forced next-token
   agreement >= 85%; the CPU's bf16 run of the same check gives 6.5% and 94%);
3. a short ``python -m engine serve`` run on CUDA whose store is then checked (integrity, run
   finished, every request ended, no failures, ticks without gaps);
4. the fused-vs-separate forward ratio: one mixed forward over a 256-token chunk plus a 32-row
   decode batch against the prefill then the decode (same tokens), interleaved rounds, medians;
   the target is >= 1.3x on a GPU.

Without CUDA it says so, runs the CPU-safe parts (the same parity, serve and ratio code on the
CPU, as a reference; CPU parity runs with or without a GPU) and reports each GPU part as not
run; the exit status is then 0 unless a CPU-safe part failed. With CUDA, any failed check makes
it exit 1.
"""
from __future__ import annotations

import argparse
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Run as a script, bench/ comes first on sys.path and bench/telemetry.py would shadow the
# telemetry package; the repo root is what is meant.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(REPO)

import torch  # noqa: E402

from engine.model.config import ModelConfig  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model.qwen3_5 import Qwen35ForCausalLM  # noqa: E402
from engine.model.forward_batch import ForwardBatch, PrefillChunk  # noqa: E402
from engine.model.runner import ModelRunner  # noqa: E402
from engine.model.tiny import perturb_parameters, random_init  # noqa: E402
from engine.cache.sequence import SequenceState  # noqa: E402
from telemetry import events as ev  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.model.cpu_features import cpu_model  # noqa: E402

# A random checkpoint transformers writes (the oracle), sized like the parity tests' one.
HF_CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_conv_kernel_dim=4, tie_word_embeddings=False)
# SmolLM-sized (as bench/forward.py): big enough that a GPU forward is not all launch overhead.
SMOL = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, head_dim=64, linear_num_key_heads=4,
                   linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                   tie_word_embeddings=True)
FUSED_TARGET = 1.3
PROMPT_LEN, NUM_GREEDY = 45, 32


@dataclass
class Check:
    name: str
    status: str             # ok / FAIL / not run / info
    detail: str
    seconds: float = 0.0

    def line(self) -> str:
        return f"[{self.status}]".ljust(10) + f"{self.name}: {self.detail} ({self.seconds:.1f} s)"


def timed(name: str, fn, *args) -> Check:
    """Run one check; an exception is that check's failure, never the script's."""
    start = time.perf_counter()
    try:
        status, detail = fn(*args)
    except Exception as exc:  # noqa: BLE001  (reported on the check's line)
        status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
    return Check(name, status, detail, time.perf_counter() - start)



# ---- 1. the GPU tests -------------------------------------------------------------------------
def run_gpu_tests(timeout_s: float) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--gpu", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                           "tests"], cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    return ("ok" if done.returncode == 0 else "FAIL"), last


# ---- 2. parity against transformers -----------------------------------------------------------
def hf_reference(directory: Path):
    """A seeded random transformers model saved to ``directory``; its fp32 CPU logits and greedy tokens."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**HF_CONFIG)).eval()
    generator = torch.Generator().manual_seed(0)
    perturb_parameters(hf, generator)  # every parameter perturbed, norms included
    with torch.no_grad():
        hf.save_pretrained(directory)
        prompt = torch.randint(0, HF_CONFIG["vocab_size"], (PROMPT_LEN,), generator=generator).tolist()
        ids = torch.tensor([prompt])
        greedy = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_GREEDY,
                             min_new_tokens=NUM_GREEDY, do_sample=False,
                             pad_token_id=HF_CONFIG["vocab_size"] - 1)[0].tolist()
        logits = hf(torch.tensor([greedy])).logits[0, PROMPT_LEN - 1:].float()  # [NUM_GREEDY + 1, V]
    return prompt, greedy[PROMPT_LEN:], logits


def parity(reference, directory: Path, device: str, dtype: torch.dtype) -> tuple[str, str]:
    """Engine logits at the prompt's end and at each teacher-forced step vs transformers' fp32 ones."""
    prompt, greedy, expected = reference
    model, _, _ = load_model(directory, dtype=dtype, device=device)
    runner = ModelRunner.build(model, num_kv_blocks=8, num_ssm_slots=2, device=device, dtype=dtype)
    seq = SequenceState(0)
    runner.pools.admit(seq)
    rows = [runner.prefill_chunk(seq, prompt, 0, PROMPT_LEN, True)]
    for token in greedy:                        # teacher forcing: feed transformers' tokens
        rows.append(runner.decode([seq], [token])[0])
    got = torch.stack(rows).float().cpu()       # [NUM_GREEDY + 1, V]
    scale = expected.abs().max().item()
    max_diff = (got - expected).abs().max().item()
    agree = (got[:-1].argmax(-1) == torch.tensor(greedy)).float().mean().item()
    if dtype != torch.float32:
        # bf16 bounds, from the CPU's bf16 run of the same check: 6.5% of the scale, 94% agreement.
        ok = max_diff <= 0.10 * scale and agree >= 0.85
        return ("ok" if ok else "FAIL"), (f"logits max|diff| {max_diff:.3f} over {len(rows)} positions, "
                                          f"{max_diff / scale:.1%} of their scale {scale:.2f} (<= 10%), "
                                          f"teacher-forced next-token agreement {agree:.0%} (>= 85%)")
    runner.pools.release(seq)                         # free-running greedy from a fresh slot
    seq = SequenceState(1)
    runner.pools.admit(seq)
    ours = [int(runner.prefill_chunk(seq, prompt, 0, PROMPT_LEN, True).argmax())]
    for _ in range(NUM_GREEDY - 1):
        ours.append(int(runner.decode([seq], [ours[-1]])[0].argmax()))
    same = sum(a == b for a, b in zip(ours, greedy))
    ok = max_diff <= 1e-3 and same == NUM_GREEDY
    return ("ok" if ok else "FAIL"), (f"logits max|diff| {max_diff:.2e} over {len(rows)} positions (<= 1e-3), "
                                      f"{same}/{NUM_GREEDY} greedy tokens equal")


# ---- 3. a short serve run and its store ------------------------------------------------------
def serve_and_check(num_requests: int, expect_cuda: bool) -> tuple[str, str]:
    with tempfile.TemporaryDirectory(prefix="chunkscope-gpu-check-") as tmp:
        run_dir = Path(tmp)
        done = subprocess.run([sys.executable, "-m", "engine", "serve", "--model", "tiny", "--run-dir", str(run_dir),
                               "--workload", "synthetic", "--requests", str(num_requests), "--rate", "20"],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return "FAIL", f"serve exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"
        conn = sqlite3.connect(f"file:{run_dir / 'telemetry.db'}?mode=ro", uri=True)
        try:
            integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
            status, device = conn.execute("SELECT status, device FROM runs").fetchone()
            by_status = dict(conn.execute("SELECT status, count(*) FROM requests GROUP BY status").fetchall())
            num_ticks, max_tick = conn.execute("SELECT count(*), max(tick) FROM ticks").fetchone()
            gpu_ms = conn.execute("SELECT count(*) FROM stream_events WHERE gpu_elapsed_ms IS NOT NULL").fetchone()[0]
        finally:
            conn.close()
    failures = sum(by_status.get(s, 0) for s in ev.FAILURE_STATUSES)
    problems = [text for bad, text in (
        (integrity != "ok", f"integrity {integrity}"), (status != "finished", f"run {status}"),
        (sum(by_status.values()) != num_requests, f"{sum(by_status.values())}/{num_requests} requests stored"),
        (any(s not in ev.END_STATUSES for s in by_status), f"requests left running: {by_status}"),
        (failures > 0, f"{failures} failed requests: {by_status}"),
        (num_ticks != (max_tick or 0) + 1, f"{num_ticks} ticks for max tick {max_tick}"),
        (expect_cuda and "cuda" not in str(device), f"ran on {device}")) if bad]
    detail = (f"device {device}; {by_status}; {num_ticks} ticks; integrity {integrity}; "
              f"{gpu_ms} stream events with GPU ms")
    return ("FAIL", "; ".join(problems) + f" ({detail})") if problems else ("ok", detail)


# ---- 4. fused vs separate forward ------------------------------------------------------------
def fused_ratio(model_name: str, device: str, dtype: torch.dtype, rounds: int,
                chunk: int = 256, batch: int = 32, context: int = 128) -> tuple[float, float, float]:
    """(separate / fused, fused ms, separate ms): medians of interleaved rounds, same inputs each time."""
    if model_name == "tiny":
        model = load_model("tiny", dtype=dtype, device=device)[0]
    else:
        model = Qwen35ForCausalLM(SMOL)
        random_init(model, seed=0)
        model.to(device=device, dtype=dtype).eval()
        model.fuse()
    blocks = batch * (context // 16 + 2) + chunk // 16 + 4
    runner = ModelRunner.build(model, num_kv_blocks=blocks, num_ssm_slots=batch + 1, device=device, dtype=dtype)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    decodes = [SequenceState(i) for i in range(batch)]
    for seq in decodes:
        runner.pools.admit(seq)
        runner.prefill_chunk(seq, torch.randint(0, vocab, (context,), generator=generator).tolist(), 0, context, True)
    newborn = SequenceState(batch)
    runner.pools.admit(newborn)
    prompt = torch.randint(0, vocab, (chunk,), generator=generator).tolist()
    last = torch.randint(0, vocab, (batch,), generator=generator).tolist()

    def rewind() -> None:  # the same positions every round (blocks stay allocated)
        for seq in decodes:
            seq.num_cached_tokens = context
        newborn.num_cached_tokens = 0

    def fused() -> None:
        runner.forward(ForwardBatch.mixed(decodes, last, PrefillChunk(newborn, prompt, 0, chunk, True)))

    def separate() -> None:
        runner.prefill_chunk(newborn, prompt, 0, chunk, True)
        runner.decode(decodes, last)

    def seconds(fn) -> float:
        rewind()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.inference_mode():
        for _ in range(3):
            seconds(fused), seconds(separate)
        times = [(seconds(fused), seconds(separate)) for _ in range(rounds)]
    fused_s = statistics.median(t[0] for t in times)
    separate_s = statistics.median(t[1] for t in times)
    return separate_s / fused_s, fused_s * 1e3, separate_s * 1e3


def ratio_check(model_name: str, device: str, dtype: torch.dtype, rounds: int, is_target: bool) -> tuple[str, str]:
    ratio, fused_ms, separate_ms = fused_ratio(model_name, device, dtype, rounds)
    detail = (f"{model_name} {str(dtype).removeprefix('torch.')}: {ratio:.2f}x (fused {fused_ms:.2f} ms, "
              f"prefill then decode {separate_ms:.2f} ms; 256-token chunk + 32 decodes)")
    if not is_target:
        return "info", detail + f"; the >= {FUSED_TARGET}x target is a GPU's"
    return ("ok" if ratio >= FUSED_TARGET else "FAIL"), detail + f"; target >= {FUSED_TARGET}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="requests of the serve run")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds of the fused-vs-separate ratio")
    parser.add_argument("--pytest-timeout", type=float, default=300.0)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    cuda = torch.cuda.is_available()
    gpu = f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}" if cuda else "no CUDA device"
    print(f"gpu_check: torch {torch.__version__}, {gpu}; CPU {cpu_model()}", flush=True)
    checks: list[Check] = []

    def report(check: Check, gpu_part: bool) -> None:
        check.gpu_part = gpu_part  # type: ignore[attr-defined]
        checks.append(check)
        print(check.line(), flush=True)

    def not_run(name: str) -> None:
        report(Check(name, "not run", "no CUDA device"), True)

    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32, not TF32
        torch.backends.cudnn.allow_tf32 = False
        report(timed("pytest --gpu -m gpu", run_gpu_tests, args.pytest_timeout), True)
    else:
        not_run("pytest --gpu -m gpu")
    with tempfile.TemporaryDirectory(prefix="chunkscope-parity-") as tmp:
        try:
            reference = hf_reference(Path(tmp))
        except ImportError as exc:
            reference = None
            report(Check("parity", "FAIL", f"transformers is needed as the oracle: {exc}"), False)
        if reference is not None:
            for dtype in (torch.float32, torch.bfloat16):
                name = f"parity cpu {str(dtype).removeprefix('torch.')} (reference)"
                report(timed(name, parity, reference, Path(tmp), "cpu", dtype), False)
            for dtype in (torch.float32, torch.bfloat16):
                name = f"parity cuda {str(dtype).removeprefix('torch.')}"
                if cuda:
                    report(timed(name, parity, reference, Path(tmp), "cuda", dtype), True)
                else:
                    not_run(name)
    report(timed(f"serve {'cuda' if cuda else 'cpu'} + store check", serve_and_check, args.requests, cuda), cuda)
    if not cuda:
        not_run("serve cuda + store check")
    report(timed("fused vs separate forward (cpu)", ratio_check, "tiny", "cpu", torch.float32,
                 max(3, args.rounds // 4), False), False)
    if cuda:
        report(timed("fused vs separate forward (cuda)", ratio_check, "smol", "cuda", torch.bfloat16,
                     args.rounds, True), True)
    else:
        not_run("fused vs separate forward (cuda)")
    failed = [c for c in checks if c.status == "FAIL"]
    cpu_parts = [c for c in checks if not c.gpu_part and c.status != "info"]  # type: ignore[attr-defined]
    if cuda:
        print(f"verdict: {'FAIL' if failed else 'PASS'} on {gpu}: {len(checks) - len(failed)}/{len(checks)} "
              f"checks ok or informational" + (f"; failed: {', '.join(c.name for c in failed)}" if failed else ""))
    else:
        print(f"verdict: GPU parts not run (no CUDA device); CPU-safe parts: "
              f"{sum(c.status == 'ok' for c in cpu_parts)}/{len(cpu_parts)} ok"
              + (f"; failed: {', '.join(c.name for c in failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
