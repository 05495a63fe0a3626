"""The training loss curve as a PNG, drawn with Pillow (no plotting library is a dependency)."""
from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

WIDTH, HEIGHT, MARGIN = 720, 360, 48
COLORS = {"main": (31, 119, 180), "mtp": (255, 127, 14)}


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` steps (the raw per-step loss is noisy: one sequence per step)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def save_loss_plot(curves: dict[str, list[float]], path: Path, title: str) -> None:
    """One line per curve (x: step, y: loss, both from 0), axes labelled at the ends."""
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    steps = max(len(v) for v in curves.values())
    top = max(max(v) for v in curves.values())
    left, right, upper, lower = MARGIN, WIDTH - MARGIN // 2, MARGIN // 2 + 8, HEIGHT - MARGIN

    def point(step: int, loss: float) -> tuple[float, float]:
        return (left + (right - left) * step / max(1, steps - 1), lower - (lower - upper) * loss / top)

    draw.rectangle([left, upper, right, lower], outline="black")
    for fraction in (0.25, 0.5, 0.75):
        y = lower - (lower - upper) * fraction
        draw.line([left, y, right, y], fill=(225, 225, 225))
        draw.text((4, y - 6), f"{top * fraction:.2f}", fill="black")
    draw.text((4, upper - 6), f"{top:.2f}", fill="black")
    draw.text((4, lower - 6), "0", fill="black")
    draw.text((right - 60, lower + 8), f"step {steps}", fill="black")
    draw.text((left, lower + 8), "0", fill="black")
    draw.text((left, 4), title, fill="black")
    for i, (name, values) in enumerate(curves.items()):
        color = COLORS.get(name, (44, 160, 44))
        draw.line([point(s, v) for s, v in enumerate(smooth(values, 25))], fill=color, width=2)
        draw.text((right - 150, upper + 6 + 14 * i), f"{name} (mean of 25 steps)", fill=color)
    image.save(path, format="PNG")
