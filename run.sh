#!/usr/bin/env bash
# Chunkscope entry point.
#   ./run.sh          set up, then start the engine (tiny-chat model, chat load) and the dashboard;
#                     the dashboard outlives the engine (a crash is read there), Ctrl-C stops both
#   ./run.sh setup    set up only (.venv + the project and its test extra)
#   ./run.sh test     set up, then run the test suite (extra args go to pytest)
# Environment:
#   CHUNKSCOPE_TORCH  torch requirement (default torch==2.13.0, the local CPU wheel;
#                     a GPU user sets e.g. CHUNKSCOPE_TORCH='torch==2.13.0' with a CUDA index)
#   PORT              dashboard port (default 8501, bound to 127.0.0.1)
#   API_PORT          the engine's OpenAI-compatible API port (default 8000, bound to 127.0.0.1)
#   RUN_DIR           run directory with telemetry.db and levers.json (default runs/default)
#   PYTHON            interpreter used to create .venv (default python3.11, else python3)
#   CHUNKSCOPE_NGRAM_MIN_MATCH  the ngram_min_match lever for the engine (default 3 here; the lever's own default is 1)
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)
VENV="$ROOT/.venv"
TORCH_REQ=${CHUNKSCOPE_TORCH:-torch==2.13.0}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    local py=${PYTHON:-$(command -v python3.11 || command -v python3)}
    echo "[setup] creating $VENV with $py"
    "$py" -m venv "$VENV"
  fi
  # The stamp records what was installed; a second run with nothing changed is a no-op.
  local stamp="$VENV/.chunkscope-stamp"
  local want
  want="$(cat pyproject.toml | sha256sum | cut -c1-16) $TORCH_REQ"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  echo "[setup] installing $TORCH_REQ and the project (test extra included)"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install -q "$TORCH_REQ"
  "$VENV/bin/python" -m pip install -q -e ".[test]" "$TORCH_REQ"
  echo "$want" > "$stamp"
}

start() {
  local port=${PORT:-8501}
  local api_port=${API_PORT:-8000}
  local run_dir=${RUN_DIR:-runs/default}
  # tiny-chat's tokens are bytes: ngram drafts after a 1- or 2-byte match are mostly rejected (bench/chat_model.py).
  # Exported, so an engine the dashboard restarts gets it too.
  export CHUNKSCOPE_NGRAM_MIN_MATCH=${CHUNKSCOPE_NGRAM_MIN_MATCH:-3}
  local engine_cmd=("$VENV/bin/python" -m engine serve --model tiny-chat --run-dir "$run_dir" --workload chat --rate 4
                    --api-port "$api_port" --api-host 127.0.0.1)
  local dash_cmd=("$VENV/bin/python" -m streamlit run dashboard/app.py --server.address 127.0.0.1 --server.port "$port" -- --run-dir "$run_dir")
  mkdir -p "$run_dir"
  "${engine_cmd[@]}" &
  local engine_pid=$!
  "${dash_cmd[@]}" &
  local dash_pid=$!
  # Ctrl-C / SIGTERM stops both (the engine drains its telemetry on SIGTERM), and an engine the
  # dashboard (re)started in its own session, named by the run dir's pid file.
  trap 'kill -TERM $engine_pid $dash_pid 2>/dev/null; wait $engine_pid $dash_pid 2>/dev/null;
        stop_dashboard_engine "$run_dir"; exit 0' INT TERM
  echo "[run] engine pid $engine_pid, dashboard http://127.0.0.1:$port (run dir $run_dir); Ctrl-C stops both"
  echo "[run] OpenAI-compatible API http://127.0.0.1:$api_port/v1 (metrics: http://127.0.0.1:$api_port/metrics)"
  local rc=0
  wait -n $engine_pid $dash_pid || rc=$?
  if kill -0 $dash_pid 2>/dev/null; then      # the engine ended (wait -n -p needs bash 5.1)
    engine_pid=""                              # reaped: its pid may name another process by now
    # The dashboard outlives the engine: it is the tool to read what happened (issue 29).
    if [ "$rc" -eq 0 ]; then
      echo "[run] engine stopped (exit 0); the dashboard stays up at http://127.0.0.1:$port; Ctrl-C stops it"
    else
      echo "[run] engine crashed (exit $rc); the dashboard stays up at http://127.0.0.1:$port to read the run" \
           "and restart it (Live page); Ctrl-C stops it" >&2
    fi
    wait $dash_pid 2>/dev/null || true
  else
    echo "[run] dashboard exited (code $rc); stopping the engine" >&2
    kill -TERM $engine_pid 2>/dev/null || true
    wait $engine_pid 2>/dev/null || true
  fi
  stop_dashboard_engine "$run_dir"
}

# An engine started from the dashboard runs in its own session; its pid file names it.
stop_dashboard_engine() {
  [ -f "$1/engine.pid" ] || return 0
  "$VENV/bin/python" -c 'import sys, pathlib; from dashboard.engine_control import stop_engine; from dashboard.paths import RunPaths
print("[run]", stop_engine(RunPaths(pathlib.Path(sys.argv[1]))))' "$1" || true
}

cmd=${1:-start}
case "$cmd" in
  setup) setup ;;
  test)
    shift
    setup
    # One thread per test process: the suite shares 2 cores with engine/dashboard subprocesses.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  start) setup; start ;;
  *) echo "usage: ./run.sh [setup|test [pytest args]]" >&2; exit 2 ;;
esac
