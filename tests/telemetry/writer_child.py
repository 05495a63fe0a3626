"""A writer process for the reliability tests (run as a script, not collected by pytest).

usage: writer_child.py DB NUM_EVENTS [--ack]  (NUM_EVENTS 0 = forever)
Emits Tick rows with tick = 0, 1, 2, ... With --ack, a monitor thread prints
``ack N`` whenever the writer reports that the first N events are committed.
"""
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from telemetry import events as ev  # noqa: E402
from telemetry.writer import TelemetryWriter  # noqa: E402


def main() -> None:
    db_path, num_events = sys.argv[1], int(sys.argv[2])
    writer = TelemetryWriter(db_path, queue_size=20_000, wal_limit_bytes=4 << 20, checkpoint_interval_s=0.2)
    writer.start_run(ev.RunStarted(time.time(), "tiny", "cpu", {}, {}, {}, {}, {}))
    print("started", flush=True)
    if "--ack" in sys.argv:
        def report() -> None:
            last = -1
            while True:
                done = writer.flushed_events
                if done != last:
                    print(f"ack {done}", flush=True)
                    last = done
                time.sleep(0.002)
        threading.Thread(target=report, daemon=True).start()
    tick = 0
    while num_events == 0 or tick < num_events:
        writer.emit(ev.Tick(tick=tick, t_ns=tick * 1000, path="decode", duration_ns=900, num_decode_tokens=8,
                            num_active=8, kv_blocks_used=tick % 64, kv_blocks_total=64))
        tick += 1
    writer.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main()
