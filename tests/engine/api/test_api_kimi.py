"""The HTTP API in front of tiny-kimi: the ``model`` name routes, a long prompt runs whole under the
reference's rule, and a prompt over the tick budget is an OpenAI error naming it."""
from __future__ import annotations

import openai
import pytest

from api_server_helpers import started_server
from serve_process import stop, wait_for
from telemetry import events as ev


@pytest.fixture(scope="module")
def kimi_server(tmp_path_factory):
    server = started_server(tmp_path_factory.mktemp("api-kimi"), "--model", "tiny-kimi", "--kv-blocks", "64",
                            env_extra={"CHUNKSCOPE_MAX_TICK_TOKENS": "400", "CHUNKSCOPE_MAX_PREFILL_TOKENS": "32"})
    yield server
    stop(server.proc)


def test_model_name_and_whole_prompt_chunk(kimi_server):
    client = kimi_server.client()
    assert [m.id for m in client.models.list().data] == ["tiny-kimi"]
    done = client.completions.create(model="tiny-kimi", prompt="x" * 120, max_tokens=5, temperature=0)
    assert done.model == "tiny-kimi" and done.usage.completion_tokens >= 1
    # The writer commits every ~100 ms: the reply can reach us before the chunk row is in the store.
    rows = wait_for(lambda: [r for r in kimi_server.rows("SELECT cap_rule, length, is_last FROM chunks")
                             if r["cap_rule"] == ev.CAP_WHOLE_PROMPT and r["length"] > 32 and r["is_last"]],
                    "the whole-prompt chunk row")
    assert rows
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)


def test_a_prompt_over_the_tick_budget_is_refused_by_name(kimi_server):
    with pytest.raises(openai.BadRequestError, match="max_tick_tokens"):
        kimi_server.client().completions.create(model="tiny-kimi", prompt="y" * 500, max_tokens=2)
