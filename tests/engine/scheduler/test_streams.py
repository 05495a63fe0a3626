"""Streams: every record / wait / sync reports once, waits link to records, CPU and CUDA paths."""
import pytest
import torch

from engine.scheduler.streams import (
    EVENT_PREFILL_DONE,
    EVENT_SECONDARY_DONE,
    STREAM_DEFAULT,
    STREAM_PREFILL,
    STREAM_SECONDARY,
    StreamSet,
)


class Log(list):
    def __call__(self, kind, stream, event_name, seq, target_stream, gpu_elapsed_ms):
        self.append(dict(kind=kind, stream=stream, event=event_name, seq=seq,
                         target=target_stream, ms=gpu_elapsed_ms))


def make(device="cpu", **kw):
    log = Log()
    return StreamSet(device, log, **kw), log


def test_reference_ordering_reports_record_then_wait_linked_by_seq():
    streams, log = make()
    seq = streams.record(EVENT_PREFILL_DONE, STREAM_PREFILL)
    assert streams.wait(STREAM_DEFAULT, EVENT_PREFILL_DONE) == seq
    assert log == [
        dict(kind="record", stream="prefill", event="prefill_done", seq=seq, target=None, ms=None),
        dict(kind="wait", stream="prefill", event="prefill_done", seq=seq, target="default", ms=None),
    ]


def test_wait_links_to_the_latest_record_of_that_event():
    streams, log = make()
    first = streams.record(EVENT_PREFILL_DONE, STREAM_PREFILL)
    other = streams.record(EVENT_SECONDARY_DONE, STREAM_SECONDARY)
    second = streams.record(EVENT_PREFILL_DONE, STREAM_PREFILL)
    assert len({first, other, second}) == 3 and first < other < second
    streams.wait(STREAM_DEFAULT, EVENT_SECONDARY_DONE)
    streams.wait(STREAM_DEFAULT, EVENT_PREFILL_DONE)
    waits = [e for e in log if e["kind"] == "wait"]
    assert [(w["seq"], w["stream"]) for w in waits] == [(other, "secondary"), (second, "prefill")]


def test_sync_reports_once_with_its_own_seq():
    streams, log = make()
    r = streams.record("x", STREAM_SECONDARY)
    s = streams.sync(STREAM_SECONDARY)
    assert s > r
    assert log[-1] == dict(kind="sync", stream="secondary", event="sync", seq=s, target=None, ms=None)
    assert len(log) == 2


def test_cpu_records_are_host_timestamps():
    streams, _ = make()
    streams.record("a", STREAM_PREFILL)
    t1 = streams.host_time_ns("a")
    streams.record("a", STREAM_PREFILL)
    assert t1 is not None and streams.host_time_ns("a") >= t1
    assert streams.host_time_ns("never") is None
    assert streams.torch_stream(STREAM_PREFILL) is None


def test_use_switches_the_current_stream_and_restores_it():
    streams, log = make()
    with streams.use(STREAM_PREFILL):
        assert streams.current == STREAM_PREFILL
        with pytest.raises(RuntimeError):
            with streams.use(STREAM_SECONDARY):
                assert streams.current == STREAM_SECONDARY
                raise RuntimeError("work failed")
        assert streams.current == STREAM_PREFILL
    assert streams.current == STREAM_DEFAULT
    assert log == []  # using a stream is not a record / wait / sync


def test_bad_calls_are_clear_errors():
    streams, log = make()
    with pytest.raises(ValueError, match="stream must be one of.*'decode'"):
        streams.record("e", "decode")
    with pytest.raises(ValueError, match="before any record"):
        streams.wait(STREAM_DEFAULT, "never_recorded")
    with pytest.raises(ValueError, match="event_name"):
        streams.record("", STREAM_PREFILL)
    with pytest.raises(ValueError, match="stream must be one of"):
        streams.sync("gpu0")
    with pytest.raises(ValueError, match="stream must be one of"):
        with streams.use("other"):
            pass
    assert log == []  # a rejected call reports nothing


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_device_without_cuda_is_refused():
    with pytest.raises(ValueError, match="CUDA is not available"):
        StreamSet("cuda", Log())


@pytest.mark.gpu
def test_cuda_streams_order_work_and_report_gpu_times():
    streams, log = make("cuda")
    a = torch.randn(2048, 2048, device="cuda")
    streams.record("start", STREAM_PREFILL)
    with streams.use(STREAM_PREFILL):
        assert torch.cuda.current_stream() == streams.torch_stream(STREAM_PREFILL)
        b = a
        for _ in range(20):
            b = b @ a / 2048**0.5                              # [2048, 2048] work on the prefill stream
    seq = streams.record(EVENT_PREFILL_DONE, STREAM_PREFILL)
    assert streams.wait(STREAM_DEFAULT, EVENT_PREFILL_DONE) == seq
    total = b.sum()                                            # on the default stream, after the wait
    expected = a.clone()
    for _ in range(20):
        expected = expected @ a / 2048**0.5
    torch.testing.assert_close(total, expected.sum(), rtol=1e-3, atol=1e-2)
    streams.sync(STREAM_PREFILL)
    sync = log[-1]
    assert sync["kind"] == "sync" and sync["ms"] is not None and sync["ms"] > 0
    assert [e["kind"] for e in log] == ["record", "record", "wait", "sync"]

    timed, tlog = make("cuda", blocking_timing=True)
    timed.record("t0", STREAM_PREFILL)
    with timed.use(STREAM_PREFILL):
        c = a @ a
    timed.record("t1", STREAM_PREFILL)
    assert tlog[0]["ms"] is None and tlog[1]["ms"] is not None and tlog[1]["ms"] > 0
    del c
