"""Every lever has help text and a row in docs/levers.md lever table (header row contains ``| lever |``)."""
from __future__ import annotations

import pathlib

from telemetry.levers import LEVERS

README = pathlib.Path(__file__).resolve().parents[2] / "docs" / "levers.md"


def lever_table_names(markdown: str) -> set[str]:
    """Names in the first column of the markdown table whose header row has a ``lever`` column."""
    names: set[str] = set()
    in_table = False
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else None
        if cells is None:
            in_table = False
            continue
        if not in_table:
            in_table = bool(cells) and cells[0].lower() == "lever"
            continue
        if set(cells[0]) <= set("-: "):
            continue  # the |---| separator row
        names.add(cells[0].strip("`"))
    return names


def test_parser_reads_only_the_lever_table():
    text = "| feature | status |\n|---|---|\n| x | done |\n\n| lever | type |\n|---|---|\n| `a_b` | bool |\n| c | int |\nend\n"
    assert lever_table_names(text) == {"a_b", "c"}


def test_every_lever_has_help_text():
    for lever in LEVERS:
        assert lever.help.strip(), lever.name


def test_every_lever_is_in_the_readme_table():
    documented = lever_table_names(README.read_text(encoding="utf-8"))
    missing = [lever.name for lever in LEVERS if lever.name not in documented]
    assert not missing, f"docs/levers.md lever table (header '| lever |') lacks: {', '.join(missing)}"
