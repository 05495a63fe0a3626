"""Tick-for-tick replay of a recorded run: read it back, re-run it, compare decisions and tokens."""
