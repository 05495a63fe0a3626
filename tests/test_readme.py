"""The README is what a newcomer reads in two minutes: short, every command it shows runs, every
figure it quotes has its source in docs/ (issue 29, item 13)."""
from __future__ import annotations

import inspect
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_BYTES = 12_000


def shell_commands(markdown: str) -> list[str]:
    """Each command of the README's ```bash blocks: continuations joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def python_module_commands(commands: list[str]) -> list[list[str]]:
    """``.venv/bin/python -m mod words...`` as argv after the interpreter."""
    found = []
    for command in commands:
        argv = shlex.split(command)
        if len(argv) >= 3 and argv[0].endswith("python") and argv[1] == "-m":
            found.append(argv[2:])
    return found


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size < MAX_README_BYTES, f"README.md is {size} bytes; keep it under {MAX_README_BYTES} (detail goes to docs/)"


def test_readme_shows_the_whole_loop():
    commands = python_module_commands(shell_commands(README.read_text(encoding="utf-8")))
    shown = {" ".join(argv[:2]) for argv in commands}
    for step in ("telemetry levers", "telemetry export", "engine replay"):
        assert step in shown, f"the README's loop lacks `python -m {step}` (shown: {sorted(shown)})"


@pytest.mark.parametrize("argv", python_module_commands(shell_commands(README.read_text(encoding="utf-8"))),
                         ids=lambda argv: " ".join(argv[:3]))
def test_every_readme_command_runs(argv):
    """Its ``--help`` exits 0, and every option the README passes is one that help lists."""
    words = []                                     # the module and its subcommands, up to the first argument
    for token in argv:
        if token.startswith("-") or not re.fullmatch(r"[a-z_]+", token) or len(words) >= 3:
            break
        words.append(token)
    help_run = subprocess.run([sys.executable, "-m", *words, "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
    assert help_run.returncode == 0, f"python -m {' '.join(words)} --help failed: {help_run.stderr[-500:]}"
    for option in (t.split("=", 1)[0] for t in argv if t.startswith("-")):
        assert re.search(rf"(^|[\s,\[]){re.escape(option)}\b", help_run.stdout), (
            f"the README passes {option} to `python -m {' '.join(words)}`, which does not list it")
    if words[:3] == ["telemetry", "levers", "list"]:     # read-only and quick: run it for real
        real = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert real.returncode == 0 and "slice_budget" in real.stdout


def test_readme_levers_and_requests_are_real():
    """A lever the README sets exists; the curl request is one the API accepts, on a route it serves."""
    from engine.api import server
    from engine.api.parse import validate
    from engine.api.protocol import ChatCompletionRequest
    from telemetry.levers import LEVERS

    commands = shell_commands(README.read_text(encoding="utf-8"))
    for argv in python_module_commands(commands):
        if argv[:3] == ["telemetry", "levers", "set"]:
            assert argv[3] in {lever.name for lever in LEVERS}, f"README sets unknown lever {argv[3]}"
    curls = [shlex.split(c) for c in commands if c.startswith("curl")]
    assert curls, "the README shows no request to send"
    for argv in curls:
        url = next(t for t in argv if t.startswith("http"))
        path = "/" + url.split("/", 3)[3]
        assert f'"{path}"' in inspect.getsource(server.build_app), f"the API serves no route {path}"
        body = argv[argv.index("-d") + 1]
        request = validate(ChatCompletionRequest, body.encode())
        assert json.loads(body)["model"] == request.model


def figures(text: str) -> set[str]:
    """Quoted measurements: 4.23x, 58.5%, 0.992, 3.64 ms, 2322.4 tok/s."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    decimals = re.findall(r"(?<![\w.])\d+\.\d+(?![\d.])(?:x|%| ms| tok/s)?", prose)   # not 2.13.0, not 127.0.0.1
    whole = re.findall(r"(?<![\w.])\d+(?:x|%)(?!\w)", prose)
    return set(decimals) | set(whole)


def test_every_readme_figure_has_its_source_in_docs():
    readme = README.read_text(encoding="utf-8")
    docs = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs").glob("*.md"))
    quoted = figures(readme)
    assert quoted, "the README quotes no figure at all (its Numbers section is gone?)"
    missing = sorted(f for f in quoted if f not in docs)
    assert not missing, f"README figures with no source in docs/: {missing}"
