"""Synthetic workload: seeded, sorted, bounded, bursty when asked."""
import statistics

import pytest

from engine.workload.request import SAMPLING_KEYS, WorkloadError
from engine.workload.synthetic import SyntheticWorkload, arrival_gaps


def make(**kw):
    return SyntheticWorkload(vocab_size=kw.pop("vocab_size", 500), **kw)


def test_same_seed_same_workload_other_seed_differs():
    a, b, c = make(seed=3).requests(), make(seed=3).requests(), make(seed=4).requests()
    assert a == b
    assert [s.prompt_tokens for s in a] != [s.prompt_tokens for s in c]
    assert list(make(seed=3)) == a  # iterating twice gives the same requests


def test_sorted_arrivals_numbered_and_lengths_in_bounds():
    specs = make(num_requests=200, prompt_len_min=5, prompt_len_max=40, output_len_min=2, output_len_max=9).requests()
    assert [s.request_id for s in specs] == list(range(200))
    assert specs[0].arrival_s == 0.0
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(specs, specs[1:]))
    assert all(5 <= s.prompt_len <= 40 and 2 <= s.max_tokens <= 9 for s in specs)
    assert all(set(s.sampling) == set(SAMPLING_KEYS) for s in specs)
    assert all(s.sampling["min_tokens"] == s.sampling["max_tokens"] for s in specs)


def test_excluded_ids_never_drawn_and_vocab_respected():
    specs = make(vocab_size=20, excluded_ids={0, 1, 2, 19}, num_requests=50).requests()
    drawn = {t for s in specs for t in s.prompt_tokens}
    assert drawn <= set(range(3, 19)) and len(drawn) == 16


def test_sampling_mix_has_greedy_and_filtered_requests():
    specs = make(num_requests=200, greedy_fraction=0.5).requests()
    greedy = [s for s in specs if s.sampling["temperature"] == 0.0]
    assert 60 < len(greedy) < 140
    sampled = [s.sampling for s in specs if s.sampling["temperature"] > 0]
    assert any(p["top_k"] > 0 for p in sampled) and any(p["top_p"] < 1 for p in sampled)
    assert any(p["min_p"] > 0 for p in sampled)
    assert len({p["seed"] for p in (s.sampling for s in specs)}) > 190
    assert all(s.sampling["temperature"] == 0.0 for s in make(greedy_fraction=1.0))


def test_rate_and_burstiness():
    import random
    rng = random.Random(1)
    poisson = arrival_gaps(rng, 4000, 5.0, "poisson", 1.0)
    bursty = arrival_gaps(rng, 4000, 5.0, "gamma", 3.0)
    for gaps, cv in ((poisson, 1.0), (bursty, 3.0)):
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(0.2, rel=0.15)
        assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.2)


def test_changing_lengths_keeps_arrivals():
    a = make(prompt_len_median=10).requests()
    b = make(prompt_len_median=100).requests()
    assert [s.arrival_s for s in a] == [s.arrival_s for s in b]


def test_describe_reports_knobs_and_observed_lengths():
    d = make(arrival="gamma", cv=2.5, rate=3.0, seed=9).describe()
    assert (d["kind"], d["arrival"], d["cv"], d["rate"], d["seed"]) == ("synthetic", "gamma", 2.5, 3.0, 9)
    assert d["num_requests"] == 64 and d["longest_prompt_len"] <= d["prompt_len_max"]


@pytest.mark.parametrize("kw, field", [
    (dict(rate=0), "rate"), (dict(arrival="uniform"), "arrival"), (dict(cv=-1), "cv"),
    (dict(prompt_len_min=10, prompt_len_max=5), "prompt_len_min"), (dict(greedy_fraction=2), "greedy_fraction"),
    (dict(vocab_size=0), "vocab_size"), (dict(rtae=3), "rtae"), (dict(num_requests=1.5), "num_requests"),
])
def test_bad_options_name_the_field(kw, field):
    with pytest.raises(WorkloadError, match=field):
        make(**kw)


def test_excluding_everything_is_an_error():
    with pytest.raises(WorkloadError, match="excluded_ids"):
        make(vocab_size=3, excluded_ids=[0, 1, 2])
