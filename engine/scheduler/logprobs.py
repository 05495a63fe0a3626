"""Log-probabilities of sampled tokens, for requests that ask for them (``features.logprobs``).

They are the model's own distribution: a log-softmax of the raw logits row, before
temperature and the filters (OpenAI's and vLLM's default), so a client can compare them
to any other run of the same checkpoint.
"""
from __future__ import annotations

import torch

from engine.scheduler.request import Request


def token_logprobs(logits_row: torch.Tensor, token: int, top_k: int) -> tuple[float, list[tuple[int, float]]]:
    """(logprob of ``token``, the ``top_k`` most likely (id, logprob), best first) from a [V] row."""
    logp = torch.log_softmax(logits_row.float(), dim=-1)                    # [V]
    top: list[tuple[int, float]] = []
    if top_k > 0:
        values, ids = torch.topk(logp, min(top_k, logp.shape[0]))            # [k], [k]
        top = list(zip(ids.tolist(), values.tolist()))
    return float(logp[token].item()), top


def record(request: Request, logits_row: torch.Tensor, token: int) -> None:
    """Keep the token's logprobs on the request when it asked for them (a no-op otherwise)."""
    k = request.features.logprobs
    if k is not None:
        request.logprobs.append(token_logprobs(logits_row, token, k))
