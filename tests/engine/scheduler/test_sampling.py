"""Sampling: greedy, filters, min_tokens, seeded replay, parameter validation."""
import math

import pytest
import torch

from engine.scheduler.sampling import (
    SamplingParams,
    effective_min_p,
    filtered_probs,
    make_generator,
    sample_next,
)

V = 32


def _logits(b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, V, generator=g) * 3.0  # [B, V]


def _sample(logits, params, seeds=None, num_generated=None, eos=frozenset()):
    b = logits.shape[0]
    seeds = seeds if seeds is not None else [p.seed for p in params]
    gens = [make_generator(s) for s in seeds]
    return sample_next(logits, params, gens, num_generated or [0] * b, set(eos))


def test_greedy_is_argmax():
    logits = _logits()
    out = _sample(logits, [SamplingParams()] * 4)
    assert out.tolist() == logits.argmax(dim=1).tolist()
    assert out.dtype == torch.long


def test_top_k_one_is_greedy():
    logits = _logits(b=6, seed=1)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(6)]
    assert _sample(logits, params).tolist() == logits.argmax(dim=1).tolist()


def test_tiny_top_p_is_greedy():
    logits = _logits(b=6, seed=2)
    params = [SamplingParams(temperature=1.0, top_p=1e-6, seed=i) for i in range(6)]
    assert _sample(logits, params).tolist() == logits.argmax(dim=1).tolist()


def test_top_k_keeps_exactly_k_tokens():
    logits = _logits(b=3, seed=3)
    probs = filtered_probs(logits, torch.ones(3), torch.tensor([1, 5, 0]), torch.ones(3), torch.zeros(3))
    assert (probs > 0).sum(dim=1).tolist() == [1, 5, V]
    top5 = set(logits[1].topk(5).indices.tolist())
    assert set(torch.nonzero(probs[1]).flatten().tolist()) == top5
    assert torch.allclose(probs.sum(dim=1), torch.ones(3))


def test_top_p_keeps_the_shortest_head_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = filtered_probs(logits, torch.ones(1), torch.tensor([0]), torch.tensor([0.7]), torch.zeros(1))
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the first two tokens stay.
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_min_p_drops_tokens_below_fraction_of_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = filtered_probs(logits, torch.ones(1), torch.tensor([0]), torch.ones(1), torch.tensor([0.35]))
    # threshold 0.35 * 0.5 = 0.175: 0.15 and 0.05 go.
    assert (probs[0] > 0).tolist() == [True, True, False, False]


def test_min_p_sampled_tokens_respect_the_threshold():
    logits = torch.log(torch.tensor([[0.4, 0.35, 0.15, 0.1]])).repeat(200, 1)
    params = [SamplingParams(temperature=1.0, min_p=0.5, seed=i) for i in range(200)]
    drawn = set(_sample(logits, params).tolist())
    assert drawn == {0, 1}


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    one = lambda t: torch.ones(1) * t  # noqa: E731
    cold = filtered_probs(logits, one(0.25), torch.tensor([0]), one(1.0), one(0.0))
    hot = filtered_probs(logits, one(4.0), torch.tensor([0]), one(1.0), one(0.0))
    assert cold[0, 0] > 0.95 and hot[0, 0] < 0.5


def test_min_tokens_suppresses_eos_and_stop_until_reached():
    logits = torch.zeros(2, V)
    logits[:, 7] = 10.0   # EOS is the argmax
    logits[:, 9] = 9.0    # a stop id second
    logits[:, 3] = 8.0
    p = SamplingParams(min_tokens=2, stop_token_ids=(9,))
    out = _sample(logits, [p, p], num_generated=[1, 2], eos={7})
    assert out.tolist() == [3, 7]  # row 0 is still under min_tokens


def test_min_tokens_applies_to_sampled_rows():
    logits = torch.full((50, V), -5.0)
    logits[:, 7] = 5.0
    params = [SamplingParams(temperature=1.0, min_tokens=1, seed=i) for i in range(50)]
    assert 7 not in _sample(logits, params, eos={7}).tolist()


def test_seeded_rows_replay_across_batch_orders_and_compositions():
    base = _logits(b=5, seed=4)
    params = [SamplingParams(temperature=1.0, top_k=20, top_p=0.95, min_p=0.01, seed=100 + i) for i in range(5)]

    def run(order, extra=0):
        rows = [base[i] for i in order]
        prm = [params[i] for i in order]
        for e in range(extra):  # unrelated requests, unseeded and greedy, in the same batch
            rows.append(torch.randn(V))
            prm.append(SamplingParams(temperature=0.7) if e % 2 else SamplingParams())
        logits = torch.stack(rows)
        gens = [make_generator(p.seed) for p in prm]
        toks = []
        for step in range(8):  # several steps: each generator advances only with its own row
            toks.append(sample_next(logits, prm, gens, [step] * len(prm), set()).tolist())
        return {order[j]: [t[j] for t in toks] for j in range(len(order))}

    reference = run([0, 1, 2, 3, 4])
    assert run([4, 2, 0, 3, 1]) == reference
    assert run([3, 1], extra=3) == {3: reference[3], 1: reference[1]}
    assert run([2]) == {2: reference[2]}
    # and the tokens really are random draws, not constant
    assert len({tok for seq in reference.values() for tok in seq}) > 5


def test_different_seeds_differ_and_same_seed_repeats():
    logits = torch.zeros(1, V)  # uniform: any token may come out
    draw = lambda s: _sample(logits, [SamplingParams(temperature=1.0, seed=s)]).item()  # noqa: E731
    assert len({draw(s) for s in range(20)}) > 3
    assert [draw(7) for _ in range(5)] == [draw(7)] * 5


def test_mismatched_lengths_are_clear_errors():
    with pytest.raises(ValueError, match="params has 1 entries for 2"):
        sample_next(torch.zeros(2, V), [SamplingParams()], [None, None], [0, 0], set())
    with pytest.raises(ValueError, match=r"logits must be \[B, V\]"):
        sample_next(torch.zeros(V), [SamplingParams()], [None], [0], set())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=math.nan), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(stop_token_ids=(3, V)), "stop_token_ids"),
        (dict(stop_token_ids=(-1,)), "stop_token_ids"),
        (dict(seed="x"), "seed"),
    ],
)
def test_validate_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"sampling.{field}"):
        SamplingParams(**kwargs).validate(V)


def test_validate_accepts_good_params():
    p = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, min_tokens=2,
                       max_tokens=4, seed=3, stop_token_ids=(0, V - 1))
    assert p.validate(V) is p


def test_dict_round_trip_and_unknown_keys():
    p = SamplingParams(temperature=0.5, top_k=3, seed=9, stop_token_ids=(1, 2))
    d = p.to_dict()
    assert d["stop_token_ids"] == [1, 2]
    assert SamplingParams.from_dict(d) == p
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(ValueError, match="unknown field.*temprature"):
        SamplingParams.from_dict({"temprature": 1.0})
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams.from_dict({"stop_token_ids": 5})
    with pytest.raises(ValueError, match="JSON object"):
        SamplingParams.from_dict([1])


def test_effective_min_p_zeroed_only_under_mtp_with_lever():
    p = SamplingParams(min_p=0.2)
    assert effective_min_p(p, "mtp", no_mtp_minp=True) == 0.0
    assert effective_min_p(p, "mtp", no_mtp_minp=False) == 0.2
    assert effective_min_p(p, "ngram", no_mtp_minp=True) == 0.2
    assert effective_min_p(p, "off", no_mtp_minp=True) == 0.2
    with pytest.raises(ValueError, match="speculation"):
        effective_min_p(p, "MTP", no_mtp_minp=True)


def test_min_p_override_replaces_row_min_p():
    logits = torch.log(torch.tensor([[0.4, 0.35, 0.15, 0.1]])).repeat(100, 1)
    params = [SamplingParams(temperature=1.0, min_p=0.9, seed=i) for i in range(100)]
    gens = [make_generator(p.seed) for p in params]
    out = sample_next(logits, params, gens, [0] * 100, set(), min_p_override=[0.0] * 100)
    assert {2, 3} & set(out.tolist())  # with min-p 0.9 only token 0 could come out


@pytest.mark.parametrize("top_k, top_p, min_p", [
    (5, 1.0, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.2), (0, 0.9, 0.05), (40, 0.8, 0.01), (0, 1.0, 0.0), (0, 0.999999, 0.0),
])
def test_sorted_head_matches_full_sort(top_k, top_p, min_p):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 500, generator=g) * torch.tensor([[0.5], [2.0], [4.0], [8.0], [1.0], [3.0]])
    args = (torch.full((6,), 0.9), torch.full((6,), top_k), torch.full((6,), top_p), torch.full((6,), min_p))
    head = filtered_probs(logits, *args, head_size=16)  # small head: some rows use it, some fall back
    full = filtered_probs(logits, *args, head_size=10_000)
    torch.testing.assert_close(head, full, rtol=1e-5, atol=1e-7)
    assert torch.equal(head > 0, full > 0)


def test_seeded_replay_holds_when_rows_take_different_paths():
    g = torch.Generator().manual_seed(6)
    scale = torch.tensor([[0.1], [9.0], [1.0], [6.0]])
    base = torch.randn(4, 3000, generator=g) * scale  # flat rows need the full sort, peaked ones do not
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=50 + i) for i in range(4)]

    def run(order):
        gens = [make_generator(params[i].seed) for i in order]
        out = [sample_next(base[order], [params[i] for i in order], gens, [0] * len(order), set()).tolist()
               for _ in range(4)]
        return {i: [step[j] for step in out] for j, i in enumerate(order)}

    reference = run([0, 1, 2, 3])
    assert run([3, 1, 0, 2]) == reference
    assert run([1]) == {1: reference[1]} and run([0]) == {0: reference[0]}
