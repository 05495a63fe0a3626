"""Parameterized read-only SQL behind the pages, aggregated in SQLite, and the cached layer pages call (`data.py`)."""
