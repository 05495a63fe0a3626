"""Issue 29, item 7: a long invalid lever value is cut in its error, on the page and in the CLI."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hypothesis import given, strategies as st

from telemetry.echo import HEAD, MAX_CHARS, MAX_WORD, cut_echo

ROOT = Path(__file__).resolve().parents[2]


def test_a_long_quoted_value_keeps_its_head_its_length_and_the_reason_after_it():
    message = "lever slice_budget: '" + "9" * 10_000 + "' is not an integer"
    assert cut_echo(message) == "lever slice_budget: '" + "9" * HEAD + "…' (10,000 characters) is not an integer"
    path = "/tmp/" + "d" * 100 + "/levers.json"        # a path is a long word too, but it fits
    assert cut_echo(f"{path}: file is empty") == f"{path}: file is empty"


@given(st.text(max_size=3_000))
def test_every_message_ends_up_short_and_a_short_one_stays_whole(message):
    cut = cut_echo(message)
    assert len(cut) <= MAX_CHARS
    if len(message) <= MAX_CHARS and all(len(word) <= MAX_WORD for word in message.split()):
        assert cut == message


def test_levers_set_cli_echoes_a_10_kb_value_cut(tmp_path):
    done = subprocess.run([sys.executable, "-m", "telemetry", "levers", "set", "max_prefill_tokens", "7x" * 5_000,
                           "--file", str(tmp_path / "levers.json")], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"invalid: lever max_prefill_tokens: '{('7x' * 20)[:HEAD]}…' (10,000 characters) "
                                  "is not an integer")
    assert done.stderr.count("\n") == 1 and len(done.stderr) < 200, done.stderr
    assert not (tmp_path / "levers.json").exists()
