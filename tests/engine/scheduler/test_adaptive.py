"""Adaptive sampling: the structured-region rule and its effect in the live loop."""
from __future__ import annotations

import torch

from engine.scheduler.adaptive import Region, StructureTokens, advance, params_for_row, region_of
from engine.scheduler.sampling import SamplingParams, sample_next

IDS = StructureTokens(code_fence=7, tool_call_start=8, tool_call_end=9)


def test_fences_toggle_and_tool_calls_open_and_close():
    assert region_of([1, 7, 2], IDS) == Region(in_code_fence=True)
    assert region_of([1, 7, 2, 7], IDS) == Region()
    assert region_of([8, 3], IDS) == Region(in_tool_call=True)
    assert region_of([8, 3, 9], IDS) == Region()
    assert advance(Region(), 7, StructureTokens(None, None, None)) == Region()


def test_params_greedy_only_inside_structure_with_the_lever_on():
    sampled = SamplingParams(temperature=0.9, top_k=5, seed=1)
    assert params_for_row(sampled, Region(in_code_fence=True), True).temperature == 0.0
    assert params_for_row(sampled, Region(in_code_fence=True), False) is sampled
    assert params_for_row(sampled, Region(), True) is sampled


def test_greedy_row_picks_the_argmax_while_plain_sampling_would_not():
    logits = torch.zeros(1, 16)
    logits[0, 3] = 0.5  # barely preferred: plain sampling at T=2 often picks something else
    params = SamplingParams(temperature=2.0, seed=0)
    adaptive = params_for_row(params, Region(in_tool_call=True), True)
    picks = {int(sample_next(logits, [params], [torch.Generator().manual_seed(s)], [0], set())[0])
             for s in range(20)}
    assert len(picks) > 1
    for s in range(20):
        assert int(sample_next(logits, [adaptive], [torch.Generator().manual_seed(s)], [0], set())[0]) == 3


def _run_one(prompt, sampling, levers):
    from engine.model.loader import load_model
    from engine.model.runner import ModelRunner
    from engine.scheduler.loop import Scheduler

    model, _, _ = load_model("tiny")
    sched = Scheduler(ModelRunner.build(model, num_kv_blocks=64, num_ssm_slots=2), levers)
    sched.submit(0, prompt, sampling)
    while sched.has_work:
        sched.step()
    return sched.done[0].output_tokens, model.code_fence_id


def test_live_loop_samples_greedily_inside_a_fence_only_with_the_lever():
    from telemetry.levers import defaults

    prompt = [72, 105, 33, 10]
    sampled = {"temperature": 1.5, "seed": 11, "max_tokens": 24, "min_tokens": 24}
    greedy, fence = _run_one(prompt + [0], {"max_tokens": 24, "min_tokens": 24}, defaults())
    fenced_prompt = prompt + [fence]
    greedy, _ = _run_one(fenced_prompt, {"max_tokens": 24, "min_tokens": 24}, defaults())
    adaptive, _ = _run_one(fenced_prompt, sampled, defaults().replace(adaptive_sampling=True))
    plain, _ = _run_one(fenced_prompt, sampled, defaults())
    closes = greedy.index(fence) + 1 if fence in greedy else len(greedy)
    assert adaptive[:closes] == greedy[:closes]
    assert plain[:closes] != greedy[:closes], "T=1.5 sampling should leave the greedy path"
