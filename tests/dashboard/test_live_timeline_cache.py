"""The Live timeline's figure is built once per run version (dashboard/data.timeline_spec)."""
from __future__ import annotations


def test_the_live_timeline_is_built_once_per_version(real_run_dir, monkeypatch):
    """A refresh with nothing new (blocked or idle engine, finished run) reuses the built figure: the Live
    page then costs a lookup a second, so the stall banner's fragment is not kept waiting behind it."""
    from dashboard.figures import charts
    from dashboard.queries import data

    built = []
    original = charts.timeline_json
    monkeypatch.setattr(charts, "timeline_json", lambda *a, **k: built.append(1) or original(*a, **k))
    data.timeline_spec.clear()
    db, run_id = str(real_run_dir.db), int(real_run_dir.one("SELECT MAX(run_id) FROM runs"))
    version = data.run_version(db, run_id)
    first = data.timeline_spec(db, run_id, version, 10.0)
    assert data.timeline_spec(db, run_id, version, 10.0) == first and len(built) == 1
    assert '"type":"bar"' in first.replace(" ", "")          # a real figure with forward bars
    data.timeline_spec(db, run_id, (version[0] + 1, *version[1:]), 10.0)   # a new version: built again
    assert len(built) == 2
