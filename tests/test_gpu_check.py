"""``python bench/gpu_check.py`` runs on a machine without CUDA: CPU-safe parts run, GPU parts say so, exit 0."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script runs its GPU parts")
def test_gpu_check_without_cuda_runs_the_cpu_parts_and_exits_0():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # run as a user would: the script finds the repo itself
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--requests", "6", "--rounds", "4"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    by_name = {line[10:].split(":", 1)[0]: line[:10].strip() for line in lines}
    for gpu_part in ("pytest --gpu -m gpu", "parity cuda float32", "parity cuda bfloat16", "serve cuda + store check",
                     "fused vs separate forward (cuda)"):
        assert by_name[gpu_part] == "[not run]", lines
    for cpu_part in ("parity cpu float32 (reference)", "parity cpu bfloat16 (reference)", "serve cpu + store check"):
        assert by_name[cpu_part] == "[ok]", lines
    assert by_name["fused vs separate forward (cpu)"] == "[info]"
    verdict = done.stdout.splitlines()[-1]
    assert verdict.startswith("verdict: GPU parts not run (no CUDA device); CPU-safe parts: 3/3 ok")
