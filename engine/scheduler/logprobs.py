"""Log-probabilities of sampled tokens (``features.logprobs``) and of the prompt's tokens
(``features.prompt_logprobs``, for echo), for requests that ask for them.

They are the model's own distribution: a log-softmax of the logits row before temperature
and the filters (OpenAI's and vLLM's default), so a client can compare them to any other run
of the same checkpoint; a token a grammar masks has -inf (the API writes it as -9999.0).
Prompt logprobs need every prompt position computed, so such a request takes no prefix-cache
hit (``prefix_step``); nothing predicts prompt token 0, so they start at token 1.
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


def wants_prompt_logprobs(request: Request) -> bool:
    return request.features.prompt_logprobs is not None


def record_prompt(request: Request, chunk_logits: torch.Tensor, offset: int) -> None:
    """Keep the logprobs of the prompt tokens a chunk's rows predict ([L, V], row j at prompt
    position offset + j predicts token offset + j + 1; the prompt's last row predicts the output)."""
    targets = request.prompt_tokens[offset + 1:offset + 1 + chunk_logits.shape[0]]
    if not targets:
        return
    logp = torch.log_softmax(chunk_logits[:len(targets)].float(), dim=-1)              # [T, V]
    ids = torch.tensor(targets, dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()                     # [T]
    k = min(request.features.prompt_logprobs, logp.shape[1])
    tops: list[list[tuple[int, float]]] = [[] for _ in targets]
    if k > 0:
        values, top_ids = torch.topk(logp, k, dim=-1)                                # [T, k]
        tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
    request.prompt_logprobs.extend(zip(chosen, tops))


def record(request: Request, logits_row: torch.Tensor, token: int) -> None:
    """Keep the token's logprobs on the request when it asked for them (a no-op otherwise)."""
    k = request.features.logprobs
    if k is not None:
        request.logprobs.append(token_logprobs(logits_row, token, k))
