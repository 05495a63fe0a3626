"""Every subcommand of ``python -m engine`` and ``python -m telemetry`` with bad arguments: one line
on stderr, no traceback, a non-zero exit. Run as real processes (forked from one parent that imported
the packages once, ``cli_fork_runner.py``), so an uncaught exception shows exactly as a user sees it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "dashboard"))
import synthetic_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("cli_fork_runner.py")
BIG = "99999999999999999999999"


def cases(d: dict[str, str]) -> list[list[str]]:
    """Bad command lines; ``d`` maps placeholders to fixture paths."""
    serve = ["engine", "serve", "--run-dir", d["run"], "--requests", "1", "--duration", "3"]
    gen = ["engine", "generate", "--prompt-ids", "1,2,3"]
    lines = [
        ["engine"], ["engine", "bogus"], ["engine", "generate", "--bogus"],
        gen + ["--max-tokens", BIG], gen + ["--max-tokens", "-1"], gen + ["--max-tokens", "abc"],
        gen + ["--max-tokens", "0"], gen + ["--dtype", "float16"], ["engine", "generate", "--prompt-ids", "x,y"],
        ["engine", "generate", "--prompt-ids", ""], ["engine", "generate", "--prompt-ids", BIG],
        ["engine", "generate"], ["engine", "generate", "--prompt-ids", "1", "--prompt", "hi"],
        gen + ["--temperature", "nan"], gen + ["--temperature", "-1"], gen + ["--top-k", "-5"],
        gen + ["--top-p", "2"], gen + ["--min-p", "-1"], gen + ["--seed", BIG], gen + ["--seed", "-1"],
        gen + ["--model", d["missing"]], gen + ["--model", d["file"]], gen + ["--temperature", "inf"],
        ["engine", "serve"], ["engine", "serve", "--run-dir", d["file"]],
        ["engine", "serve", "--run-dir", d["file"] + "/sub"],
        serve + ["--kv-blocks", "0"], serve + ["--kv-blocks", "-1"], serve + ["--kv-blocks", BIG],
        serve + ["--ssm-slots", "0"], serve + ["--ssm-slots", BIG], serve + ["--rate", "-1"],
        serve + ["--rate", "nan"], serve + ["--rate", "0"], serve + ["--requests", "-1"],
        serve + ["--duration", "-5"], serve + ["--duration", "nan"], serve + ["--workload", "bogus"],
        serve + ["--workload", "trace:" + d["missing"]], serve + ["--workload", "bundle:" + d["missing"]],
        serve + ["--workload", "trace:" + d["garbage"]], serve + ["--model", d["missing"]],
        serve + ["--threads", "-1"], serve + ["--time-scale", "-1"], serve + ["--length-scale", "0"],
        serve + ["--limit", "-1"], serve + ["--start", "-1"], serve + ["--seed", "-1"], serve + ["--seed", BIG],
        serve + ["--kv-cache-dtype", "int3"], serve + ["--kv-cache-mb", "0"], serve + ["--kv-cache-mb", "nan"],
        serve + ["--kv-cache-mb", "inf"], serve + ["--kv-cache-mb", "0.0001"],
        serve + ["--kv-cache-dtype", "innerq4", "--kv-cache-mb", "0.0001"],
        serve + ["--kv-cache-dtype", "innerq4", "--kv-recent-tokens", "0"],
        serve + ["--kv-cache-dtype", "innerq4", "--kv-group-size", "24"],
        gen + ["--kv-cache-dtype", "innerq8", "--kv-calib-tokens", "0"], gen + ["--kv-sink-tokens", BIG],
        gen + ["--compile", "sometimes"], serve + ["--compile", "bogus"],
        ["engine", "replay", d["good"], "--kv-cache-dtype", "bogus"],
        ["engine", "replay", d["good"], "--kv-cache-mb", "-1"],
        ["engine", "replay"], ["engine", "replay", d["missing"]], ["engine", "replay", d["missing"] + ".zip"],
        ["engine", "replay", d["garbage"]], ["engine", "replay", d["garbage_zip"]], ["engine", "replay", d["dir"]],
        ["engine", "replay", d["good"], "--flip", "bogus"], ["engine", "replay", d["good"], "--flip", "nope=1"],
        ["engine", "replay", d["good"], "--flip", "max_prefill_tokens=-1"],
        ["engine", "replay", d["good"], "--run", BIG], ["engine", "replay", d["good"], "--run", "-1"],
        ["engine", "replay", d["good"], "--model", d["missing"]],
        ["telemetry"], ["telemetry", "bogus"], ["telemetry", "runs"],
        ["telemetry", "runs", "--db", d["missing"]], ["telemetry", "runs", "--db", d["dir"]],
        ["telemetry", "runs", "--db", d["garbage"]],
        ["telemetry", "summary", "--db", d["good"], "--run", BIG],
        ["telemetry", "summary", "--db", d["good"], "--run", "-1"],
        ["telemetry", "summary", "--db", d["good"], "--run", "abc"], ["telemetry", "summary", "--db", d["missing"]],
        ["telemetry", "summary", "--db", d["dir"]], ["telemetry", "summary", "--db", d["garbage"]],
        ["telemetry", "tail", "--db", d["missing"], "--once"],
        ["telemetry", "tail", "--db", d["good"], "--run", "77", "--once"],
        ["telemetry", "tail", "--db", d["good"], "--run", BIG, "--once"],
        ["telemetry", "tail", "--db", d["good"], "--interval", "-1"],
        ["telemetry", "tail", "--db", d["good"], "--interval", "nan"],
        ["telemetry", "tail", "--db", d["dir"], "--once"], ["telemetry", "tail", "--db", d["garbage"], "--once"],
        ["telemetry", "export", "--db", d["missing"], "-o", d["out"]],
        ["telemetry", "export", "--db", d["good"], "-o", d["missing"] + "/deeper/x.zip"],
        ["telemetry", "export", "--db", d["good"], "-o", d["file"]],
        ["telemetry", "export", "--db", d["good"], "-o", d["out"], "--since-s", "-1"],
        ["telemetry", "export", "--db", d["good"], "-o", d["out"], "--since-s", "5", "--until-s", "1"],
        ["telemetry", "export", "--db", d["good"], "-o", d["out"], "--since-s", "100000"],
        ["telemetry", "export", "--db", d["good"], "-o", d["out"], "--since-s", "nan"],
        ["telemetry", "export", "--db", d["good"], "-o", d["out"], "--since-s", "1e300"],
        ["telemetry", "export", "--db", d["good"], "-o", d["out"], "--until-s", "1e19"],
        ["telemetry", "export", "--db", d["good"], "-o", d["out"], "--run", BIG],
        ["telemetry", "export", "--db", d["dir"], "-o", d["out"]],
        ["telemetry", "levers"], ["telemetry", "levers", "get", "--file", d["dir"]],
        ["telemetry", "levers", "get", "--file", d["garbage"]],
        ["telemetry", "levers", "set", "max_prefill_tokens", "-5", "--file", d["levers"]],
        ["telemetry", "levers", "set", "max_prefill_tokens", BIG, "--file", d["levers"]],
        ["telemetry", "levers", "set", "max_prefill_tokens", "12.7", "--file", d["levers"]],
        ["telemetry", "levers", "set", "nope", "1", "--file", d["levers"]],
        ["telemetry", "levers", "set", "bisect_no_mix", "true", "--file", d["dir"]],
        ["telemetry", "levers", "set", "bisect_no_mix", "true", "--file", d["garbage"]],
        ["telemetry", "levers", "validate", "--file", d["missing"]],
        ["telemetry", "levers", "validate", "--file", d["dir"]],
        ["telemetry", "levers", "validate", "--file", d["garbage"]],
        ["telemetry", "levers", "validate"],
        ["engine", "serve", "--run-dir", d["long"]], ["engine", "generate", "--prompt-ids", "1", "--model", d["long"]],
        ["engine", "replay", d["long"]], ["engine", "replay", d["long"] + ".zip"],
        ["telemetry", "runs", "--db", d["long"]], ["telemetry", "export", "--db", d["good"], "-o", d["long"] + ".zip"],
        ["telemetry", "levers", "get", "--file", d["long"]],
        ["telemetry", "levers", "set", "bisect_no_mix", "true", "--file", d["long"]],
    ]
    return lines


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    good = tmp / "good.db"
    synthetic_run.write_run(good, synthetic_run.SimConfig(num_requests=4), status="finished")
    (tmp / "garbage.db").write_text("this is not a database\n" * 50)
    (tmp / "garbage.zip").write_text("not a zip")
    (tmp / "file.txt").write_text("a plain file")
    (tmp / "adir").mkdir()
    paths = {"good": str(good), "garbage": str(tmp / "garbage.db"), "garbage_zip": str(tmp / "garbage.zip"),
             "file": str(tmp / "file.txt"), "dir": str(tmp / "adir"), "missing": str(tmp / "missing.db"),
             "run": str(tmp / "run"), "out": str(tmp / "out.zip"), "levers": str(tmp / "levers.json"),
             "long": str(tmp / ("x" * 5000))}
    lines = cases(paths)
    for index, argv in enumerate(lines):   # each serve its own run dir: two engines on one dir refuse
        if paths["run"] in argv:
            argv[argv.index(paths["run"])] = f"{paths['run']}-{index}"
    case_file = tmp / "cases.json"
    case_file.write_text(json.dumps([{"argv": argv, "timeout_s": 90} for argv in lines]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if not k.startswith("CHUNKSCOPE_") or k == "CHUNKSCOPE_CACHE"}
    done = subprocess.run([sys.executable, str(RUNNER), str(case_file)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_sweep_covers_every_subcommand(sweep):
    commands = {tuple(r["argv"][:2]) for r in sweep}
    commands |= {tuple(r["argv"][:3]) for r in sweep if r["argv"][1:2] == ["levers"]}
    for expected in [("engine", "generate"), ("engine", "serve"), ("engine", "replay"), ("telemetry", "runs"),
                     ("telemetry", "summary"), ("telemetry", "tail"), ("telemetry", "export"),
                     ("telemetry", "levers", "get"), ("telemetry", "levers", "set"),
                     ("telemetry", "levers", "validate")]:
        assert expected in commands
    assert len(sweep) >= 70


def test_bad_arguments_get_one_line_and_a_nonzero_exit(sweep):
    bad = []
    for result in sweep:
        lines = [line for line in result["stderr"].splitlines() if line.strip()]
        # argparse prints its usage line first; the error is then the one line that follows.
        errors = [line for line in lines if not line.startswith(("usage:", "       "))]
        if result["rc"] == 0 or "Traceback" in result["stderr"] or len(errors) != 1:
            bad.append(f"{' '.join(result['argv'])}\n    rc={result['rc']} "
                       f"stderr={result['stderr'][-600:]!r}")
    assert not bad, f"{len(bad)} of {len(sweep)} command lines misbehave:\n" + "\n".join(bad)
