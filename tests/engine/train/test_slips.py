"""Copy slips: copied words swapped for others of their kind and left out of the loss, the rest trained."""
from __future__ import annotations

import itertools
import random
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.train.corpus import ChatCorpus
from engine.train.slips import MAX_SLIPS, POOLS, SLIP_SHARE, with_slip
from engine.train.tasks import draw_task


def same_kind(a: str, b: str) -> bool:
    return (a.isdigit() and b.isdigit()) or any(a in pool and b in pool for pool in POOLS)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10 ** 6))
def test_a_slip_swaps_copied_words_for_others_of_their_kind_and_nothing_else(seed):
    rng = random.Random(seed)
    thought = draw_task(rng, thinking=True).thought
    segments = with_slip(rng, thought)
    slipped = [text for text, trained in segments if not trained]
    assert 1 <= len(slipped) <= MAX_SLIPS   # every task's thought copies a name, a number or a word
    # Putting the original words back where the slips are gives the thought, character for character.
    pattern = "".join(re.escape(text) if trained else r"(\w+)" for text, trained in segments)
    originals = re.fullmatch(pattern, thought)
    assert originals is not None
    for original, swapped in zip(originals.groups(), slipped):
        assert original != swapped and same_kind(original, swapped)


def test_a_thought_that_copies_nothing_comes_back_whole():
    assert with_slip(random.Random(0), "Nothing to copy here.") == [("Nothing to copy here.", True)]


def test_the_corpus_leaves_slips_out_of_the_loss_and_trains_every_other_reply_token():
    corpus = ChatCorpus(7, 1024)
    think_end, im_start = (corpus.tokenizer.token_to_id(t) for t in ("</think>", "<|im_start|>"))
    replies = slipped = 0
    for sequence in itertools.islice(corpus, 150):
        tokens, targets = sequence.tokens, sequence.targets
        at = 0
        for trained, group in itertools.groupby(zip(tokens, targets), key=lambda pair: pair[1]):
            run = [token for token, _ in group]
            # Untrained runs are prompts (from <|im_start|>) or slips: a word inside a thought, between
            # trained tokens, with no </think> between the prompt and it.
            if not trained and run[0] != im_start:
                prompt_at = max(i for i in range(at) if tokens[i] == im_start)
                assert think_end not in tokens[prompt_at:at] and targets[at - 1] and targets[at + len(run)]
                assert len(run) <= 12   # a word, not a stretch of reply
                slipped += 1
            at += len(run)
        replies += sequence.tokens.count(think_end)
    # Slips in about SLIP_SHARE of the thoughts (1 .. MAX_SLIPS each): the share is seeded, not exact.
    assert SLIP_SHARE * replies * 0.6 <= slipped <= SLIP_SHARE * replies * MAX_SLIPS * 1.4
