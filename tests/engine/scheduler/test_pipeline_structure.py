"""The tick is a pipeline of stages over values (issue 30), checked on the source and on a real tick:
no import circle in the scheduler and speculation packages (``TYPE_CHECKING`` and function-level
imports included), no stage that imports the loop or takes the ``Scheduler``, and one prefill tick
that walks admit -> plan -> execute -> sample -> account without re-entering the loop."""
from __future__ import annotations

import ast
import pathlib
import sys

import pytest

from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.scheduler.loop import Scheduler
from telemetry import events as ev
from telemetry.levers import defaults

ROOT = pathlib.Path(__file__).resolve().parents[3]
PACKAGES = ("engine.scheduler", "engine.spec")
LOOP = "engine.scheduler.loop"
STAGES = ("admit", "plan", "execute", "execute_chunk", "sample", "account")


def engine_modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in (ROOT / "engine").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """Every engine module ``path`` imports, anywhere in it (``if TYPE_CHECKING:`` and functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name in modules}


def graph(prefixes: tuple[str, ...]) -> dict[str, set[str]]:
    modules = engine_modules()
    inside = {m for m in modules if m.startswith(prefixes)}
    return {m: {d for d in imports_of(modules[m], modules) if d in inside and d != m} for m in inside}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(edges[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_scheduler_and_spec_imports_are_acyclic():
    assert find_cycle(graph(PACKAGES)) is None


def test_speculation_sources_do_not_import_the_scheduler():
    """The scheduler runs the speculative step; ``engine/spec`` only drafts and verifies (one direction)."""
    edges = graph(PACKAGES)
    back = {(m, d) for m, deps in edges.items() if m.startswith("engine.spec") for d in deps
            if d.startswith("engine.scheduler")}
    assert back == set()


def test_no_stage_imports_the_loop_or_takes_the_scheduler():
    modules = engine_modules()
    offenders = []
    for name, path in modules.items():
        if not name.startswith(PACKAGES) or name == LOOP:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if LOOP in imports_of(path, modules):
            offenders.append(f"{name} imports {LOOP}")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.arg == "sched" or "Scheduler" in ast.unparse(arg.annotation or ast.Constant(None)):
                        offenders.append(f"{name}.{node.name} takes {arg.arg}")
    assert offenders == []


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")[0]


def test_a_prefill_tick_walks_the_stages_in_order_without_reentering_the_loop(tiny):
    rows: list = []
    runner = ModelRunner.build(tiny, num_kv_blocks=64, num_ssm_slots=4)
    sched = Scheduler(runner, defaults().replace(max_prefill_tokens=16), emit=rows.append)
    sched.submit(0, list(range(1, 20)), {"max_tokens": 20})
    while not sched.active:
        sched.step()
    sched.submit(1, list(range(3, 60)), {"max_tokens": 4})   # its first chunk fuses with request 0's decode
    if sched.last_path == ev.PATH_PREFILL:
        sched.step()    # the decodes are owed this tick
    calls: list[tuple[str, str]] = []
    scheduler_dir = str(ROOT / "engine" / "scheduler")

    def profile(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename.startswith(scheduler_dir):
            calls.append((pathlib.Path(frame.f_code.co_filename).stem, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        sched.step()
    finally:
        sys.setprofile(None)
    chunk = [r for r in rows if isinstance(r, ev.ChunkDecision)][-1]
    assert chunk.request_id == 1 and chunk.path == ev.PATH_MIXED
    assert {fn for module, fn in calls if module == "loop"} == {"step", "context"}, "a stage re-entered the loop"
    entered = [fn for module, fn in calls if module in STAGES and fn in ("admit", "plan_tick", "execute",
                                                                         "execute_chunk", "sample", "account")]
    assert entered == ["admit", "plan_tick", "execute", "execute_chunk", "sample", "account"]
