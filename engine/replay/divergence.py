"""Why a replay diverged: a scheduling decision that differs, or a token that differs, and for a
token, whether the model nearly tied there (numerics) or clearly preferred one token (a bug).

A decision (a chunk row, a tick's path or token counts, a status) uses no logits: the scheduler is
deterministic given the same tokens, and the first divergence is the earliest, so no differing token
came before it. A decision that differs first is therefore a bug (or the ``--flip`` asked for it).

A token that differs first is judged by the logits at its position. Different kernels (AVX2 vs
AVX-512 vs AMX code paths) or another batch shape round differently; that can only flip a choice the
model almost tied on. So the top-2 margin, and the gap between the recorded and the replayed token's
logits, say which: within a few roundings of the dtype at the logits' scale is numerics, wider is a bug.
"""
from __future__ import annotations

from typing import Any

import torch

from engine.cache.sequence import SequenceState
from engine.model.forward_batch import ForwardBatch, PrefillChunk
from engine.model.runner import ModelRunner

# The largest recorded-vs-replayed logit gap, relative to max(1, |top-1 logit|), that rounding can
# explain. bf16 carries 8 significant bits (eps 2^-7 = 0.0078): 3e-2 is about four roundings of a
# logit, what a bf16 forward differs by between batch shapes (issue 26: logprobs 0.005 apart at
# -5.4). fp32 (eps 1.2e-7) differs between kernels by accumulated rounding through every layer,
# far below 1e-4 of a logit; a wider gap is no rounding.
NEAR_TIE_RELATIVE = {"float32": 1e-4, "bfloat16": 3e-2}
DECISION_FIELDS = ("chunk", "tick", "status")
BLOCK_SIZE = 16


def sequence_logits(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] float32: row j is the model's next-token logits after tokens[:j+1], from one
    standalone forward in the model's own dtype (full-precision K/V, a fresh SSM slot)."""
    weight = next(model.parameters())
    runner = ModelRunner.build(model, num_kv_blocks=-(-len(tokens) // BLOCK_SIZE) + 1, num_ssm_slots=1,
                               block_size=BLOCK_SIZE, device=weight.device, dtype=weight.dtype)
    seq = SequenceState(request_id=0)
    runner.pools.admit(seq)
    out = runner.forward(ForwardBatch(prefill=PrefillChunk(seq, tokens, 0, len(tokens), True, every_row=True)))
    runner.pools.release(seq)
    return out.chunk_logits.float()                                                    # [T, V]


def token_margin(logits: torch.Tensor, recorded: int | None, replayed: int | None) -> dict[str, Any]:
    """From one logits row [V]: the top-2 margin, and where the recorded and replayed tokens stand."""
    top = torch.topk(logits, 2)
    ranks = torch.argsort(logits, descending=True)                                     # [V]

    def standing(token: int | None) -> dict[str, Any] | None:
        if token is None or not 0 <= token < logits.shape[0]:
            return None
        return {"token": token, "logit": round(float(logits[token]), 6),
                "rank": int((ranks == token).nonzero()[0, 0]) + 1}

    return {"top1": {"token": int(top.indices[0]), "logit": round(float(top.values[0]), 6)},
            "top2": {"token": int(top.indices[1]), "logit": round(float(top.values[1]), 6)},
            "top2_margin": float(top.values[0] - top.values[1]),
            "recorded": standing(recorded), "replayed": standing(replayed)}


def classify(first: dict[str, Any] | None, margin: dict[str, Any] | None, dtype: str,
             flipped: bool = False) -> dict[str, Any] | None:
    """Pure: the cause of ``first`` (``compare``'s first divergence), given the logits at its position
    when it is a token (``token_margin``). None when nothing diverged."""
    if first is None:
        return None
    kind = first["field"].split(".")[0].split("[")[0]
    if kind in DECISION_FIELDS:
        return {"kind": "decision", "verdict": "flip" if flipped else "bug",
                "why": f"the first difference is a scheduling decision ({first['field']}), which no logit feeds"
                       + (": the flipped lever changed it" if flipped else "")}
    if margin is None or margin["recorded"] is None or margin["replayed"] is None:
        return {"kind": "token", "verdict": "bug", "why": "one side has no token at that position"}
    gap = abs(margin["recorded"]["logit"] - margin["replayed"]["logit"])
    tolerance = NEAR_TIE_RELATIVE.get(dtype, NEAR_TIE_RELATIVE["float32"]) * max(1.0, abs(margin["top1"]["logit"]))
    near_tie = gap <= tolerance
    return {"kind": "token", "verdict": "numerics" if near_tie else "bug",
            "top2_margin": margin["top2_margin"], "logit_gap": gap, "tolerance": tolerance, "logits": margin,
            "why": (f"the model nearly tied there: the recorded and replayed tokens' logits are {gap:.3g} apart, "
                    f"within {tolerance:.3g} ({dtype} rounding)") if near_tie else
                   (f"the model clearly preferred one token: the recorded and replayed tokens' logits are "
                    f"{gap:.3g} apart, more than {dtype} rounding explains ({tolerance:.3g})")}


def explain(report: dict[str, Any], recorded, model, dtype: str, flipped: bool = False) -> dict[str, Any] | None:
    """The cause of the report's first divergence; for a token, from the raw model logits (before
    penalties, bias, grammar masks and temperature) at that position of the recorded context."""
    first = report.get("first_divergence")
    margin = None
    if first is not None and first["field"].startswith("output_tokens["):
        index = int(first["field"].removeprefix("output_tokens[").rstrip("]"))
        request = next(r for r in recorded.requests if r.request_id == first["request_id"])
        context = list(request.prompt_tokens) + recorded.output_tokens()[request.request_id][:index]
        row = sequence_logits(model, context)[-1]                                      # [V]
        margin = token_margin(row, first["recorded"], first["replayed"])
    return classify(first, margin, dtype, flipped)


def cause_line(cause: dict[str, Any] | None) -> str:
    """One line for the text report."""
    if cause is None:
        return "cause:     none (nothing diverged)"
    line = f"cause:     {cause['kind']} differs, {cause['verdict']}: {cause['why']}"
    if cause["kind"] == "token" and "top2_margin" in cause:
        line += f"; top-2 margin {cause['top2_margin']:.3g}"
    return line
