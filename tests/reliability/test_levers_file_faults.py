"""Every way the levers file can go bad, against a serving engine.

The engine must keep its last good levers, log exactly one rejection per bad
version (a ``lever_changes`` row with status ``rejected``), keep ticking, and
apply the file again once it is good.
"""
from __future__ import annotations

import json
import os
import shutil
import time

from reliability_helpers import query, wait_for

from telemetry.levers import MAX_FILE_BYTES, write_levers_file

SETTLE_S = 1.5   # longer than the watcher's 1 s stat recheck: a repeated rejection would show up


def rejections(db):
    return query(db, "SELECT reason FROM lever_changes WHERE run_id = 1 AND status = 'rejected' ORDER BY id")


def applied(db):
    return query(db, "SELECT name, new, file_version FROM lever_changes "
                     "WHERE run_id = 1 AND status = 'applied' AND source = 'file' ORDER BY id")


def replace_bytes(path, body: bytes) -> None:
    """What a careless tool does: the new content appears at once (new inode)."""
    tmp = path.with_name(".garbage.tmp")
    tmp.write_bytes(body)
    os.replace(tmp, path)


def good_body(version: int, **levers) -> bytes:
    return json.dumps({"version": version, "levers": levers}).encode()


def test_bad_levers_files_are_rejected_once_each_and_the_engine_recovers(start_engine):
    engine = start_engine("--rate", "10", "--kv-blocks", "64")
    db, path = engine.run_dir / "telemetry.db", engine.run_dir / "levers.json"
    engine.wait_tick(3)

    def expect(num_rejected: int, num_applied: int, what: str):
        wait_for(lambda: len(rejections(db)) >= num_rejected and len(applied(db)) >= num_applied,
                 20, what)
        assert (len(rejections(db)), len(applied(db))) == (num_rejected, num_applied), what

    write_levers_file(path, 1, {"slice_budget": 32})
    expect(0, 1, "version 1 applied")
    bad_versions = [
        ("truncated", lambda: os.truncate(path, 0), "empty"),
        ("garbage", lambda: replace_bytes(path, b"\x89PNG\r\n\x1a\n" + os.urandom(64)), "binary"),
        ("same garbage rewritten", None, None),
        ("not JSON", lambda: replace_bytes(path, b"slice_budget = 8\n"), "invalid JSON"),
        ("oversized", lambda: replace_bytes(path, b" " * (MAX_FILE_BYTES + 1) + good_body(9)), "limit"),
        ("schema", lambda: replace_bytes(path, good_body(9, slice_budget=-4)), "slice_budget"),
        ("directory", lambda: (path.unlink(), path.mkdir()), "not a regular file"),
        ("FIFO", lambda: (path.rmdir(), os.mkfifo(path)), "not a regular file"),
        ("half-written", lambda: (path.unlink(), replace_bytes(path, good_body(2, slice_budget=48)[:20])),
         "invalid JSON"),
    ]
    num_rejected = 0
    for what, action, reason_word in bad_versions:
        if action is None:   # the same bad bytes again, as a new file: still one version, no new row
            body = path.read_bytes()
            replace_bytes(path, body)
            time.sleep(SETTLE_S)
        else:
            action()
            num_rejected += 1
        expect(num_rejected, 1, f"{what}: one rejection")
        if reason_word:
            assert reason_word in rejections(db)[-1][0], (what, rejections(db)[-1])

    # The editor finishes its write in place: the file is good again and applies.
    with open(path, "ab") as handle:
        handle.write(good_body(2, slice_budget=48)[20:])
    expect(num_rejected, 2, "version 2 applied after the half-written file was completed")
    path.unlink()                                  # deleted: keep the values, no rejection
    time.sleep(SETTLE_S)
    write_levers_file(path, 3, {"slice_budget": 48, "bisect_no_mix": True})
    expect(num_rejected, 3, "version 3 applied after the file was deleted")

    time.sleep(SETTLE_S)
    assert len(rejections(db)) == num_rejected == 8, "exactly one rejection row per bad version"
    assert applied(db) == [("slice_budget", "32", 1), ("slice_budget", "48", 2), ("bisect_no_mix", "true", 3)]
    before = engine.status()["tick"]
    engine.wait_tick(before + 3, timeout_s=30)     # never blocked, not even by the FIFO
    assert engine.stop() == 0
    log = (engine.run_dir / "engine.log").read_text()
    assert log.count("levers: rejected") == num_rejected
    assert "Traceback" not in log
    shutil.rmtree(engine.run_dir, ignore_errors=True)
