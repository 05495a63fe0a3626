"""Draft sources: where a speculative step's guesses come from, one function per kind.

- ``ngram``: prompt-lookup on the token history (``ngram.py``), no forward;
- ``mtp``: the checkpoint's multi-token-prediction module, k single-row forwards of its layer
  (``ModelRunner.mtp_draft``);
- ``self``: an early exit of the model itself after ``self_draft_layers`` layers, then the
  final norm and LM head, one token at a time (``ModelRunner.self_draft``).
Model drafts are greedy (the argmax of the draft head): a point-mass draft, which the exact
acceptance rule in ``engine/scheduler/spec_step.py`` accepts with the request's own sampler.
"""
from __future__ import annotations

from engine.cache.kv import KVCacheExhausted
from engine.model.runner import ModelRunner
from engine.spec.kinds import SPEC_MTP, SPEC_NGRAM, SPEC_SELF
from engine.spec.ngram import propose_drafts

MAX_NGRAM = 3   # the longest suffix prompt lookup tries; the shortest is the ngram_min_match lever


def self_draft_layers(lever: int, num_hidden_layers: int) -> int:
    """Layers the self draft runs: the lever (0 = half the model), clamped to [1, layers - 1]."""
    wanted = lever if lever > 0 else num_hidden_layers // 2
    return max(1, min(wanted, num_hidden_layers - 1))


def propose(kind: str, runner: ModelRunner, seq, history: list[int], num_drafts: int, *,
            self_layers_lever: int = 0, ngram_min_match: int = 1) -> list[int]:
    """Up to ``num_drafts`` drafts for the token after ``history[-1]`` (the token the step feeds in).

    Model kinds allocate the blocks the verify will need first (k + 1 positions); with no
    blocks they draft nothing (the step then decodes plainly).
    """
    if num_drafts < 1:
        return []
    if kind == SPEC_NGRAM:
        return propose_drafts(history, max_ngram=MAX_NGRAM, min_ngram=ngram_min_match, num_drafts=num_drafts)
    try:
        runner.pools.blocks.allocate(seq, num_drafts + 1)
    except KVCacheExhausted:
        return []
    if kind == SPEC_MTP:
        return runner.mtp_draft(seq, history[-1], num_drafts)
    if kind == SPEC_SELF:
        layers = self_draft_layers(self_layers_lever, runner.config.num_hidden_layers)
        return runner.self_draft(seq, history[-1], num_drafts, layers)
    raise ValueError(f"no draft source for speculation kind {kind!r}")
