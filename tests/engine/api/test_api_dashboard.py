"""The dashboard shows API traffic: each request's source on the Requests page, the API request
rate and the first-token rules on the Live page (AppTest against the API server's own store)."""
from __future__ import annotations

from pathlib import Path

from dashboard.paths import ENV_RUN_DIR
from dashboard.words import plural
from serve_process import wait_for

APP = str(Path(__file__).resolve().parents[3] / "dashboard" / "app.py")


def open_page(monkeypatch, run_dir, page=None):
    from streamlit.testing.v1 import AppTest
    monkeypatch.setenv(ENV_RUN_DIR, str(run_dir))
    at = AppTest.from_file(APP, default_timeout=30)
    at.run()
    if page is not None:
        at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_live_and_requests_pages_show_api_traffic(api_server, monkeypatch):
    api_server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "dashboard"}], max_tokens=3,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    wait_for(lambda: api_server.rows("SELECT 1 FROM requests WHERE first_token_rules = 'thinking' "
                                     "AND status = 'finished'"), "the thinking request row")
    num_api = api_server.rows("SELECT count(*) AS n FROM requests WHERE source = 'api'")[0]["n"]
    num_thinking = api_server.rows("SELECT count(*) AS n FROM chunks WHERE first_token_rules LIKE '%thinking%'")[0]["n"]
    live = open_page(monkeypatch, api_server.run_dir)
    metrics = {m.label: m.value for m in live.metric}
    assert metrics["requests api / workload"] == f"{num_api} / 0"
    assert metrics["thinking (think-end banned)"] == str(num_thinking)
    assert float(next(v for k, v in metrics.items() if k.startswith("API requests/s"))) >= 0
    requests = open_page(monkeypatch, api_server.run_dir, "requests")
    table = requests.dataframe[0].value
    assert set(table["source"]) == {"api"} and "thinking" in set(table["first_token_rules"].dropna())


def test_the_id_the_client_got_finds_its_request_on_both_pages(api_server, monkeypatch):
    """The response id ends in the engine's request id, the x-chunkscope-request-ids header names it,
    streamed chunks carry the same id, and typing the id into Requests' search or Chunks' id box
    shows that request (issue 29, item 2)."""
    client = api_server.client()
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "find me"}], max_tokens=3)
    reply = raw.parse()
    header = raw.headers["x-chunkscope-request-ids"]
    assert reply.id.startswith("chatcmpl-") and reply.id.endswith(f"-{header}")
    request_id = int(header)
    row = wait_for(lambda: api_server.rows("SELECT source, prompt_len FROM requests WHERE request_id = ? "
                                           "AND status = 'finished'", (request_id,)), "the request's row")
    assert row and row[0]["source"] == "api" and row[0]["prompt_len"] == reply.usage.prompt_tokens
    stream = client.completions.create(model="tiny", prompt="stream me", max_tokens=2, n=2, stream=True)
    chunk_ids = {chunk.id for chunk in stream}
    assert len(chunk_ids) == 1 and chunk_ids.pop().rsplit("-", 1)[1].isdigit()
    wait_for(lambda: api_server.rows("SELECT 1 FROM chunks WHERE request_id = ?", (request_id,)), "its chunks")

    requests = open_page(monkeypatch, api_server.run_dir, "requests")
    requests.text_input(key="requests_search").input(reply.id).run()
    assert not requests.exception and not requests.error
    assert list(requests.dataframe[0].value["request_id"]) == [request_id]
    requests.text_input(key="requests_search").input("").run()
    requests.multiselect(key="requests_source").set_value(["workload"]).run()
    assert "No request matches this search." in [i.value for i in requests.info]
    chunks = open_page(monkeypatch, api_server.run_dir, "chunks")
    chunks.text_input(key="chunks_request").input(reply.id).run()
    assert not chunks.exception and not chunks.error
    num_chunks = api_server.rows("SELECT count(*) AS n FROM chunks WHERE request_id = ?", (request_id,))[0]["n"]
    assert any(f"**{plural(num_chunks, 'chunk decision')}**" in m.value for m in chunks.markdown)
