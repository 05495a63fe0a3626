"""Bundle export and the divergence check on the Runs page (Streamlit calls only).

Build: a button writes the chosen run's bundle into ``RUN_DIR/bundles/``; the
page then shows where and how big, and offers the newest bundles for
download, read from disk on click. Replay: pick a bundle, and either replay
it as recorded or with one lever flipped; the per-request verdict stays in
the session (a small dict) until the next check.
"""
from __future__ import annotations

from typing import Any

import streamlit as st

from dashboard import bundles, replay_check
from dashboard.panels import tables
from dashboard.context import RunContext
from telemetry.bundle import BundleError
from telemetry.levers import LEVERS, LEVERS_BY_NAME

RESULT_KEY = "replay_result"
BUILT_KEY = "bundle_built"


def _window() -> tuple[float | None, float | None, str | None]:
    """The two boxes and what is wrong with them. No ``min_value``: a browser box with one shows a typed
    -5 while Streamlit silently resets the value to empty; here -5 arrives and gets its message."""
    cols = st.columns(2)
    since = cols[0].number_input("from s (optional)", value=None, step=1.0, key="bundle_since_s",
                                 help="keep rows from this many seconds after the run started (0 or more)")
    until = cols[1].number_input("until s (optional)", value=None, step=1.0, key="bundle_until_s",
                                 help="keep rows before this many seconds after the run started")
    problem = bundles.window_problem(since, until)
    if problem:
        st.error(problem)
    return since, until, problem


def export_section(ctx: RunContext, run_id: int) -> None:
    st.subheader("Bug-report bundle")
    st.caption("One zip: manifest, a consistent telemetry snapshot, a Perfetto trace, the workload and a "
               "summary. Built only when you click, into the run directory's `bundles/` folder.")
    since, until, problem = _window()
    if st.button(f"Build bundle of run {run_id}", key="bundle_build", icon=":material/archive:",
                 disabled=problem is not None):
        bar = st.progress(0.0, text=f"exporting run {run_id}…")

        def progress(step: str) -> None:
            share, label = bundles.step_fraction(step)
            bar.progress(share, text=f"exporting run {run_id}: {label}")
        try:
            result = bundles.build_bundle(ctx.paths, run_id, since, until, progress=progress)
        except (BundleError, OSError) as exc:
            st.session_state[BUILT_KEY] = None
            st.error(f"Bundle not built: {exc}")
        else:
            st.session_state[BUILT_KEY] = str(result.path)
        bar.empty()
    built = st.session_state.get(BUILT_KEY)
    if built:
        st.success(f"Wrote `{built}`.")
    files = bundles.list_bundles(ctx.paths)
    if not files:
        st.caption(f"No bundles in `{bundles.bundle_dir(ctx.paths)}` yet.")
        return
    st.markdown(f"**Bundles** in `{bundles.bundle_dir(ctx.paths)}` (newest first)")
    for i, bundle in enumerate(files):
        left, right = st.columns([4, 1])
        left.markdown(f"`{bundle.path.name}` · {bundles.format_size(bundle.num_bytes)}")
        right.download_button("Download", data=bundles.file_reader(bundle.path), file_name=bundle.path.name,
                              mime="application/zip", key=f"bundle_download_{i}", on_click="ignore",
                              icon=":material/download:")


def _value_widget(name: str) -> Any:
    lever = LEVERS_BY_NAME[name]
    key = f"replay_value_{name}"
    if lever.type is bool:
        return st.toggle(f"{name} =", value=not lever.default, key=key, help=lever.help)
    if lever.type is int:
        lo, hi = lever.bounds or (None, None)
        return int(st.number_input(f"{name} =", min_value=lo, max_value=hi, value=lever.default, step=1,
                                   key=key, help=lever.help))
    choices = list(lever.choices or (lever.default,))
    return st.selectbox(f"{name} =", choices, index=choices.index(lever.default), key=key, help=lever.help)


def _run(ctx: RunContext, bundle: str, flips: dict[str, Any]) -> None:
    what = ", ".join(f"{k}={v}" for k, v in flips.items()) or "no flip"
    with st.status(f"Replaying {bundle.rsplit('/', 1)[-1]} ({what})…", expanded=True) as status:
        bar = st.progress(0.0, text="starting the replay (loading the model)…")

        def show(tick: int, total: int) -> None:
            bar.progress(min(1.0, tick / total) if total else 0.0, text=f"tick {tick:,} of {total:,}")

        try:
            outcome = replay_check.run_replay(ctx.paths, bundle, flips, on_progress=show)
        except replay_check.ReplayCheckError as exc:
            status.update(label="Replay failed", state="error", expanded=False)
            st.session_state[RESULT_KEY] = {"error": str(exc), "flips": flips, "bundle": bundle}
            return
        status.update(label=f"Replay done in {outcome.seconds:.1f} s", state="complete", expanded=False)
    st.session_state[RESULT_KEY] = {"report": outcome.report, "flips": flips, "bundle": outcome.bundle,
                                    "seconds": outcome.seconds}


def _show_result(result: dict) -> None:
    what = ", ".join(f"`{k}={v}`" for k, v in result["flips"].items()) or "no flip"
    st.caption(f"last check: `{result['bundle']}` with {what}")
    if "error" in result:
        st.error(result["error"])
        return
    report = result["report"]
    level, text = replay_check.headline(report)
    (st.success if level == "success" else st.warning)(text)
    stall = report.get("stall") or {}
    if stall.get("lines"):      # lever changes, blocked time and TTFT p99, recorded vs replayed
        blocked = bool((stall.get("blocked_s") or {}).get("recorded"))
        (st.warning if blocked else st.info)("  \n".join(stall["lines"]), icon=":material/timer:")
    tables.show(replay_check.request_table(report), key="replay_requests")


def replay_section(ctx: RunContext) -> None:
    st.subheader("Divergence check (replay)")
    st.caption("Re-runs a bundle's workload with `python -m engine replay --json` in a subprocess. As recorded, "
               "a CPU run must reproduce every decision and token; with a lever flipped, decisions change and a "
               "batch-invariant engine still produces the same tokens.")
    files, num_left_out = bundles.replayable_bundles(bundles.list_bundles(ctx.paths))
    if num_left_out:
        st.caption(f"{num_left_out} time-windowed bundle(s) not offered: they hold only part of a run, and a "
                   "replay needs the whole run.")
    if not files:
        st.info("Build a whole-run bundle above first: the replay reads it.")
        return
    labels = {str(b.path): b.label for b in files}
    bundle = st.selectbox("bundle", list(labels), format_func=labels.get, key="replay_bundle")
    cols = st.columns([2, 2, 1, 1])
    with cols[0]:
        name = st.selectbox("lever to flip", [lever.name for lever in LEVERS], key="replay_lever")
    with cols[1]:
        value = _value_widget(name)
    if cols[2].button("Replay with flip", key="replay_flip", type="primary"):
        _run(ctx, bundle, {name: value})
    if cols[3].button("Replay (no flip)", key="replay_plain"):
        _run(ctx, bundle, {})
    result = st.session_state.get(RESULT_KEY)
    if result:
        _show_result(result)


def render(ctx: RunContext, run_id: int) -> None:
    export_section(ctx, run_id)
    replay_section(ctx)
