"""``python -m engine.train``: train ``tiny-chat`` from its seed and write the shipped files.

Writes into ``--out`` (default: the embedded ``engine/model/tiny_chat/``): config.json and
model.safetensors (MTP head and vision tower included), preprocessor_config.json, tokenizer.json
(the image tokens included), chat_template.jinja, loss_curve.png and manifest.json (the settings,
the recorded losses and every file's sha256). The vision tower is not trained: it is seeded after
training (``seeded_tower``), so ``./run.sh``'s chat workload runs images through it; text-only
requests never touch it. ``--family moe`` trains ``tiny-chat-moe`` (tiny-moe's configuration and an
MTP head, text only) into ``engine/model/tiny_chat_moe/``. ``./run.sh`` never runs this: it loads the
shipped files (engine/model/tiny_chat.py).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from engine.model.qwen3_5 import Qwen35ForCausalLM
from engine.model.tiny import random_init, write_checkpoint
from engine.model.tiny_chat import SHIPPED_DIRS, write_manifest
from engine.model.tiny_vl import TINY_VL_PREPROCESSOR, TINY_VL_VISION, write_vision_checkpoint
from engine.model.tokenizer import VISION_TOKENS, build_byte_tokenizer
from engine.model.vision import attach_vision
from engine.train.corpus import TEMPLATE
from engine.train.loop import FAMILIES, TrainSettings, train
from engine.train.loss_plot import save_loss_plot

FINAL_WINDOW = 100   # the recorded final loss: mean main loss over the last this-many steps
EARLY_STEPS = 5      # the recorded early losses a cheap test reproduces
TOWER_SEED_OFFSET = 2  # the tower's seed: the training seed + this (+1 seeds the MTP head)


def seeded_tower(model: Qwen35ForCausalLM, seed: int) -> Qwen35ForCausalLM:
    """Attach tiny-vl's tower shape (merger out = tiny-chat's width, image tokens 266-268) with seeded,
    untrained weights; the text weights are untouched."""
    attach_vision(model, TINY_VL_VISION)
    random_init(model.visual, seed + TOWER_SEED_OFFSET)
    return model


def write_shipped(model: Qwen35ForCausalLM, out: Path, seed: int, family: str = "dense") -> None:
    """The checkpoint files, tokenizer and template: tiny-chat with its tower in transformers'
    ConditionalGeneration layout, tiny-chat-moe text only (the CausalLM layout)."""
    if family == "dense":
        write_vision_checkpoint(seeded_tower(model, seed), out, TINY_VL_PREPROCESSOR)
        build_byte_tokenizer(VISION_TOKENS).save(str(out / "tokenizer.json"))
    else:
        write_checkpoint(model, out)
        build_byte_tokenizer().save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(TEMPLATE.strip() + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.train", description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=tuple(FAMILIES), default="dense",
                   help="dense: tiny-chat (the default); moe: tiny-chat-moe, tiny-moe's configuration")
    p.add_argument("--out", type=Path, default=None, help="where to write the model (default: the shipped one)")
    p.add_argument("--steps", type=int, default=TrainSettings.steps, help="optimizer steps (one sequence each)")
    p.add_argument("--seed", type=int, default=TrainSettings.seed)
    p.add_argument("--threads", type=int, default=TrainSettings.threads, help="torch CPU threads")
    args = p.parse_args(argv)
    if args.steps < FINAL_WINDOW:
        p.error(f"--steps must be >= {FINAL_WINDOW}")
    if args.threads < 1:
        p.error("--threads must be >= 1")
    settings = TrainSettings(seed=args.seed, steps=args.steps, threads=args.threads, family=args.family)
    name = "tiny-chat" if args.family == "dense" else "tiny-chat-moe"
    started = time.perf_counter()
    model, losses = train(settings)
    seconds = time.perf_counter() - started
    out = args.out or SHIPPED_DIRS[name]
    out.mkdir(parents=True, exist_ok=True)
    write_shipped(model, out, settings.seed, settings.family)
    main_curve, mtp_curve = [s.main for s in losses], [s.mtp for s in losses]
    save_loss_plot({"main": main_curve, "mtp": mtp_curve}, out / "loss_curve.png",
                   f"{name} training loss (seed {settings.seed}, {settings.steps} steps)")
    final = sum(main_curve[-FINAL_WINDOW:]) / FINAL_WINDOW
    final_mtp = sum(mtp_curve[-FINAL_WINDOW:]) / FINAL_WINDOW
    write_manifest(out, {"settings": settings.to_dict(), "final_loss": round(final, 5),
                         "final_mtp_loss": round(final_mtp, 5), "final_window": FINAL_WINDOW,
                         "early_losses": [round(s.main, 5) for s in losses[:EARLY_STEPS]],
                         "train_seconds": round(seconds, 1)})
    print(f"{name}: {settings.steps} steps in {seconds:.0f} s, final loss {final:.4f} "
          f"(mtp {final_mtp:.4f}, mean of the last {FINAL_WINDOW} steps) -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
