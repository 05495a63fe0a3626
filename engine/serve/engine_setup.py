"""Build a ready engine (model, caches, scheduler) and describe it for the run row."""
from __future__ import annotations

import hashlib
import json
import logging
import platform
import sqlite3
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from engine.api.launch import redacted_command_line
from engine.cache.kv_options import budget_bytes, kv_quant_config
from engine.model.compiled_decode import resolve_compile, use_persistent_cache
from engine.model.cpu_features import assumed_cpu, cpu_flags, cpu_model, isa_summary, resolve_dtype
from engine.model.embedded import EMBEDDED_MODELS, checkpoint_dir_of  # noqa: F401  (callers import it here)
from engine.model.fault import ForwardFault
from engine.model import reproducible
from engine.model.loader import load_model
from engine.model import tiny
from engine.model.roofline import MachineRates, measure_rates
from engine.model.runner import ModelRunner
from engine.multimodal.image_store import ImageStore
from engine.multimodal.limits import ImageLimits
from engine.multimodal.request_images import RequestImages
from engine.scheduler.loop import Scheduler
from telemetry.events import RunStarted
from telemetry.levers import LeverValues

log = logging.getLogger("chunkscope.compile")

BLOCK_SIZE = 16
# The bandwidth probe's buffer: larger than a server CPU's last-level cache, small enough to be
# quick (~0.1 s) at start.
ROOFLINE_STREAM_MIB = 128
VERSIONED_PACKAGES = ("torch", "streamlit", "plotly", "watchdog", "sqlite-utils", "safetensors", "tokenizers")


@dataclass
class EngineSetup:
    model_name: str
    checkpoint_dir: Path
    model: Any
    config: Any
    tokenizer: Any
    runner: ModelRunner
    scheduler: Scheduler
    engine_config: dict[str, Any] = field(default_factory=dict)
    roofline_s: float = 0.0          # how long measuring this machine's roofline rates took (serve)

    @property
    def special_ids(self) -> set[int]:
        """Token ids a workload must not draw for prompt text (EOS, think, tool-call, fence, image tokens)."""
        names = ("eos_token_id", "think_start_id", "think_end_id", "tool_call_start_id",
                 "tool_call_end_id", "code_fence_id")
        ids = {i for i in (getattr(self.model, n, None) for n in names) if i is not None}
        vision = getattr(self.model, "vision_config", None)
        if vision is not None:   # a stray placeholder token would not match the request's images
            ids |= {vision.image_token_id, vision.vision_start_token_id, vision.vision_end_token_id}
        return ids


def build_engine(model_name: str, *, kv_blocks: int, ssm_slots: int, levers: LeverValues,
                 seed: int = 0, device: str | None = None, dtype: torch.dtype | str = torch.float32,
                 emit=None, prefix_cache: bool = True, threads: int | None = None,
                 fault: ForwardFault | None = None, kv_cache: dict[str, Any] | None = None,
                 ep_size: int = 1, compile: str = "off", compile_warmup: bool = True,
                 measure_roofline: bool = False, numerics: str = "native",
                 image_store: ImageStore | None = None, image_limits: ImageLimits | None = None) -> EngineSetup:
    """``fault``: the test-only forward fault hook (``engine/model/fault.py``), recorded in the config.
    ``kv_cache``: ``kv_cache_options`` (format, byte budget, InnerQ windows), recorded in the config.
    ``dtype``: a torch dtype, or a ``--dtype`` choice ('auto' picks by the CPU's flags, cpu_features.py).
    ``ep_size`` > 1: load rank 0's share of a MoE model's experts (``engine/distributed`` starts the ranks).
    ``compile``: --compile auto / on / off (``compiled_decode.resolve_compile``); with ``compile_warmup``
    every batch bucket up to ``ssm_slots`` rows compiles here, before the run starts, else on first use.
    ``measure_roofline``: time this machine's GEMM rate and read bandwidth once (``serve``), so every tick
    records its forwards' roofline time; the rates go in the config (``roofline_rates``, ``log_roofline``).
    ``image_store``: where a vision checkpoint's requests find their images by content hash (a run's
    ``images/``; default: in memory). ``image_limits``: what a request's images may be (default
    ``ImageLimits()``; on a text-only model a ValueError), recorded in a vision model's config.
    ``numerics``: 'reproducible' builds and steps the engine inside ``engine/model/reproducible.py``'s mode
    (the compiled decode step off: its kernels are per-ISA), recorded in the config as ``numerics``.
    """
    reproducible.check_choice(numerics)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_choice = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    dtype = getattr(torch, resolve_dtype(dtype_choice, device=device))
    # Tiny ops gain nothing from a thread team, and on a shared, busy machine its
    # spin-waits cost 10x: the tiny model runs single-threaded unless told otherwise.
    threads = threads or (1 if model_name in EMBEDDED_MODELS else None)
    if threads:
        torch.set_num_threads(threads)
    if kv_blocks < 1 or ssm_slots < 1:
        raise ValueError(f"--kv-blocks and --ssm-slots must be >= 1, got {kv_blocks} and {ssm_slots}")
    directory = checkpoint_dir_of(model_name)
    with reproducible.entered(numerics):  # init-time math (rotary frequencies, decay rates) pinned too
        model, config, tokenizer = load_model(directory, dtype=dtype, device=device, ep_size=ep_size)
    if numerics == reproducible.REPRODUCIBLE:
        reproducible.check_supported(model, ep_size=ep_size, device=device)
        compile = "off"
    kv_cache = dict(kv_cache or {"kv_cache_dtype": "auto"})
    compile_settings = resolve_compile(compile, device) if ep_size == 1 else None
    if compile_settings is not None:
        use_persistent_cache(tiny.cache_root() / "inductor")
    with reproducible.entered(numerics):
        runner = ModelRunner.build(model, num_kv_blocks=kv_blocks, num_ssm_slots=ssm_slots,
                                   block_size=BLOCK_SIZE, device=device, dtype=dtype, fault=fault,
                                   kv_quant=kv_quant_config(kv_cache), kv_budget_bytes=budget_bytes(kv_cache),
                                   compile=compile_settings)
    images = RequestImages.for_model(model, directory, image_store, image_limits or ImageLimits())
    if image_limits is not None and images is None:   # serve's --limit-mm-per-prompt, or a vision run's replay
        raise ValueError(f"image limits given (--limit-mm-per-prompt, or the replayed run's config), but "
                         f"{model_name} has no vision tower (it takes no images)")
    grammars = None
    if tokenizer is not None:
        from engine.grammar.compiler import GrammarCompiler
        grammars = GrammarCompiler.for_model(model, tokenizer, runner.vocab_size)
    rates, roofline_s = _measure_roofline(dtype) if measure_roofline else (None, 0.0)
    scheduler = Scheduler(runner, levers, emit=emit, run_seed=seed, prefix_cache=prefix_cache,
                          detokenize=tokenizer.decode if tokenizer is not None else None, grammars=grammars,
                          machine_rates=rates, numerics=numerics,
                          images=images)
    engine_config = {"numerics": numerics, "kv_blocks": kv_blocks, "block_size": BLOCK_SIZE, "ssm_slots": ssm_slots,
                     "device": device, "dtype": str(dtype).removeprefix("torch."), "seed": seed,
                     "dtype_choice": dtype_choice, "cpu_model": cpu_model(), "cpu_isa": isa_summary(cpu_flags()),
                     **({"dtype_assumed_cpu": assumed_cpu()} if assumed_cpu() else {}),
                     "prefix_cache": prefix_cache, "threads": torch.get_num_threads(),
                     **{k: v for k, v in kv_cache.items() if v is not None},
                     "kv_cache_blocks": runner.pools.blocks.num_blocks, "kv_cache_bytes": runner.pools.kv_bytes_total,
                     # Paged K/V layers (full attention + the MTP module's) and their bytes.
                     "kv_layers": len(model.kv_layer_ids), "kv_bytes": runner.pools.kv_store.num_bytes,
                     **_kv_kind(model),
                     "mtp_layers": len(model.mtp.layers) if model.has_mtp_head else 0,
                     **({"image_limits": images.limits.to_dict()} if images is not None else {})}
    engine_config["compile"] = _compile_description(runner, compile, compile_settings, ssm_slots, compile_warmup)
    if fault is not None:
        engine_config["fault_forward"] = fault.describe()
    if rates is not None:
        # The GEMM rate is the forward's dtype's (bf16 AMX tiles run ~10x the fp32 rate): every tick's
        # roofline is judged against the kernels its forward could use.
        engine_config["roofline_rates"] = {"gemm_gflop_s": round(rates.flops_per_s / 1e9, 2),
                                           "read_gb_s": round(rates.bytes_per_s / 1e9, 2),
                                           "gemm_dtype": engine_config["dtype"], "gemm_library": rates.gemm}
    return EngineSetup(model_name, directory, model, config, tokenizer, runner, scheduler, engine_config, roofline_s)


def _measure_roofline(dtype: torch.dtype) -> tuple[MachineRates, float]:
    """This machine's GEMM rate and read bandwidth, timed once (``roofline.measure_rates``), and the seconds
    that took."""
    started = time.perf_counter()
    rates = measure_rates(dtype, stream_mib=ROOFLINE_STREAM_MIB)
    return rates, time.perf_counter() - started


def log_roofline(setup: EngineSetup, log: logging.Logger) -> None:
    """One line with the rates ``measure_roofline`` found (logged once the run is known to start, so a
    bad workload still fails in one line)."""
    rates = setup.engine_config.get("roofline_rates")
    if rates is not None:
        log.info("roofline rates: square GEMM %.1f GFLOP/s in %s (%s), read %.1f GB/s (measured in %.2f s)",
                 rates["gemm_gflop_s"], rates.get("gemm_dtype", "float32"), rates.get("gemm_library", "mm"),
                 rates["read_gb_s"], setup.roofline_s)


def _compile_description(runner: ModelRunner, choice: str, settings, max_rows: int, warm_up: bool) -> dict:
    """The run row's record of the compiled decode step; compiles the buckets first when ``warm_up``."""
    compiled = runner.compiled_decode
    described: dict[str, Any] = {"choice": choice, "active": compiled is not None}
    if settings is not None:
        described.update(settings.describe())
    if settings is not None and compiled is None:
        described["eager_because"] = ("an InnerQ KV cache calibrates in Python" if runner.pools.innerq is not None
                                      else "this model's decode is not compiled (expert routing)")
    if compiled is not None and warm_up:
        seconds = compiled.warm_up(max_rows)
        compiled.take_events()  # recorded here, on the run row, not as tick events
        log.info("compiled the decode step for batch buckets %s in %.1f s (%s backend, %d graphs)",
                 sorted(compiled.buckets_run), seconds, settings.backend, compiled.num_graphs)
        described.update(compile_s=round(seconds, 3), warmed_buckets=sorted(compiled.buckets_run),
                         num_graphs=compiled.num_graphs)
    return described


def checkpoint_hash(directory: Path) -> str:
    """sha256 over config + weight files (name, size, content): which weights a run used."""
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.json")) + sorted(directory.glob("*.safetensors")):
        digest.update(path.name.encode())
        digest.update(str(path.stat().st_size).encode())
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "sqlite": sqlite3.sqlite_version}
    for name in VERSIONED_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def device_description(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"{device} ({props.name}, CUDA {torch.version.cuda})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"cpu ({cpu}, {torch.get_num_threads()} threads)"


def run_started_row(setup: EngineSetup, args: Any, workload: dict[str, Any], argv: list[str]) -> RunStarted:
    config_path = setup.checkpoint_dir / "config.json"
    model_config = json.loads(config_path.read_text()) if config_path.exists() else {}
    return RunStarted(
        started_at=time.time(), model=setup.model_name if setup.model_name in EMBEDDED_MODELS else setup.checkpoint_dir.name,
        device=device_description(setup.engine_config["device"]), config=setup.engine_config,
        model_config=model_config, versions=versions(), workload=workload,
        levers=setup.scheduler.levers.as_dict(), command_line=" ".join(["python -m engine", *redacted_command_line(argv[1:])])
        if argv and argv[0].endswith("__main__.py") else " ".join(redacted_command_line(argv)),
        checkpoint_hash=checkpoint_hash(setup.checkpoint_dir))


def _kv_kind(model) -> dict:
    """What one cached token holds per K/V layer: MLA latent rows, or every head's K and V."""
    config = model.config
    if model.is_mla:
        return {"kv_kind": "mla_latent", "kv_values_per_token_layer": config.latent_dim,
                "kv_full_values_per_token_layer": config.full_kv_width}
    return {"kv_kind": "per_head", "kv_values_per_token_layer": 2 * config.num_key_value_heads * config.head_dim}
