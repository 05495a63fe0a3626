"""Bug-report bundles: one zip that holds everything needed to read and replay a run.

Format (``BUNDLE_FORMAT = 1``), a zip with exactly these members:

``manifest.json`` (UTF-8 JSON object)::

    {
      "bundle_format": 1,                  # refuse to open when > ours
      "schema_version": 1,                 # telemetry schema of telemetry.db; refuse when > ours
      "created_at": 1796209600.0,          # unix seconds (display only)
      "chunkscope": {"version": "0.1.0" | null, "git_revision": "<40 hex>" | null},
      "run": {"run_id": 1, "status": "running|finished|crashed", "model": "tiny",
              "started_at": <unix s>, "finished_at": <unix s> | null},
      "versions": {"run": {python, torch, sqlite, streamlit, plotly, watchdog, ...},   # engine side
                   "exporter": {python, sqlite, streamlit, plotly, watchdog, sqlite-utils, torch}},
      "device": "cpu (AMD EPYC, 1 threads)",
      "engine_config": {...},              # runs.config
      "model_config": {...},               # runs.model_config (config.json text part)
      "checkpoint_hash": "<sha256 hex>",
      "workload": {...},                   # runs.workload (the generator's description, paths sanitized)
      "levers": {
        "start": {"max_prefill_tokens": 256, ...},        # runs.levers: values in force at tick 0
        "changes": [{"tick": 40, "t_ns": 123, "name": "bisect_no_mix", "old": false,
                     "new": true, "source": "file", "status": "applied" | "rejected",
                     "reason": null, "file_version": 3}, ...]   # by (tick, id); all rows
      },                                   # replay applies only status == "applied", at the
                                           # start of the change's tick (before scheduling it)
      "time_range": {"since_ns": null | int, "until_ns": null | int,  # the window asked for
                     "is_windowed": false,
                     "first_ns": int | null, "last_ns": int | null,   # data extent in the bundle
                     "first_tick": int | null, "last_tick": int | null},
      "command_line": "python -m engine serve --model tiny --run-dir . ...",
      "environment": {"OMP_NUM_THREADS": "1", "CHUNKSCOPE_...": "..."},   # allow-list only
      "counts": {"<table>": rows, ...},    # rows of each table in telemetry.db
      "files": {"telemetry.db": {"bytes": n, "sha256": hex}, "trace.json.gz": ..., ...}
    }

All ``*_ns`` times are run-relative monotonic nanoseconds (the ``t_ns`` of the
rows). Paths: a path inside the run directory is written relative to it;
any other absolute path becomes its basename. No environment variable outside
``ENV_ALLOW_LIST`` / ``ENV_ALLOW_PREFIXES`` is ever written.

``telemetry.db``: a SQLite snapshot of that one run (same schema as the live
store; other runs' rows removed; with a window, rows whose ``t_ns`` falls
outside [since_ns, until_ns) removed, and requests kept when their lifetime
overlaps the window). Taken with ``VACUUM INTO`` from a read-only connection,
so it is consistent while the engine writes; every other member is derived
from this snapshot, so the files agree with each other.

``workload.jsonl``: one JSON object per request of the snapshot, sorted by
(arrival_tick, request_id), in the format ``engine/workload/bundle.py`` reads::

    {"request_id": 3, "arrival_tick": 12, "arrival_ns": 410000000, "arrival_s": 0.41,
     "prompt_tokens": [..], "sampling": {"temperature": 0.0, "max_tokens": 16,
     "seed": 7, ...}, "seed": 7, "conversation_id": null, "turn": null}

The recorded outputs (for a replay's token comparison) are in
``telemetry.db``: ``requests.output_tokens`` and the ``tokens`` table; the
recorded chunk decisions are the ``chunks`` table.

``trace.json.gz``: Chrome trace JSON (gzip) for Perfetto, see ``perfetto.py``.

``summary.md``: the run in numbers, errors by message, lever changes, top preemptions.

``open_bundle(path) -> Bundle`` validates and extracts a bundle (``BundleError``
with one clear message otherwise); ``export_bundle(...)`` writes one.
"""
from __future__ import annotations

BUNDLE_FORMAT = 1
BUNDLE_MEMBERS = ("manifest.json", "telemetry.db", "trace.json.gz", "workload.jsonl", "summary.md")
