"""bench/forward.py's output: one result row per forward kind (the JSON object's rows) and its printed line."""
from __future__ import annotations

import statistics

from engine.model.roofline import ForwardCost, MachineRates, best_rates


def result_row(name: str, row: str, batch: int, key: str, cost: ForwardCost, times: dict[str, list[float]],
               rates: list[MachineRates], compile_s: float | None) -> dict:
    """One row of the output: medians, both sides' steady and cold times, the roofline and its shares."""
    def median(side: str, suffix: str = "") -> float | None:
        values = times.get(f"{side} {key}{suffix}")
        return statistics.median(values) if values else None

    def best(side: str, suffix: str = "") -> float | None:
        values = times.get(f"{side} {key}{suffix}")
        return min(values) if values else None

    ours_s, theirs_s = median("ours"), median("theirs")
    ours_cold, theirs_cold = median("ours", " cold"), median("theirs", " cold")
    # The same statistic on both sides of each share: the best of the probes taken before this
    # row's blocks against the best forward (and, beside it, median against median). Best-of
    # rates are the highest the machine showed, so the roofline is never a lowered bar.
    rate = best_rates(rates)
    median_rate = MachineRates(statistics.median(r.flops_per_s for r in rates),
                               statistics.median(r.bytes_per_s for r in rates))
    roofline_s = rate.seconds(cost)
    bound = "compute" if cost.flops / rate.flops_per_s >= cost.bytes / rate.bytes_per_s else "memory"
    ratio = (lambda a, b: None if a is None or b is None else a / b)
    gemms = times.get(f"gemms {key}")
    return {"model": name, "row": row, "batch": batch,
            "ours_ms": ours_s * 1e3, "theirs_ms": None if theirs_s is None else theirs_s * 1e3,
            "ratio": ratio(theirs_s, ours_s), "roofline_ms": roofline_s * 1e3,
            "roofline_share": roofline_s / best("ours"),
            "ours_cold_ms": ours_cold * 1e3, "theirs_cold_ms": None if theirs_cold is None else theirs_cold * 1e3,
            "ratio_cold": ratio(theirs_cold, ours_cold), "roofline_share_cold": roofline_s / best("ours", " cold"),
            "ours_best_ms": best("ours") * 1e3, "ours_max_ms": max(times[f"ours {key}"]) * 1e3,
            "steady_steps": len(times[f"ours {key}"]), "cold_steps": len(times[f"ours {key} cold"]),
            "probes": len(rates), "compiled": compile_s is not None and row == "decode", "compile_s": compile_s,
            "gemm_gflops": rate.flops_per_s / 1e9, "gemm_library": rate.gemm, "read_gbs": rate.bytes_per_s / 1e9,
            "roofline_share_median": median_rate.seconds(cost) / ours_s,
            "theirs_roofline_share": ratio(roofline_s, best("theirs")),
            "bound": bound, "gflop": cost.flops / 1e9, "mbytes": cost.bytes / 1e6,
            # The decode GEMMs alone: no forward using these kernels can beat this share.
            "gemms_only_ms": min(gemms) * 1e3 if gemms else None,
            "gemms_only_share": roofline_s / min(gemms) if gemms else None}


def row_text(name: str, r: dict, prompt_len: int) -> str:
    """One printed line per row."""
    ms = (lambda value: "n/a" if value is None else f"{value:8.2f} ms")
    times = (lambda value: "n/a" if value is None else f"{value:5.2f}x")
    their_share = "n/a" if r["theirs_roofline_share"] is None else f"{r['theirs_roofline_share']:5.1%}"
    label = f"prefill {prompt_len}" if r["row"] == "prefill" else f"decode b{r['batch']:<2}"
    cold = ("" if r["row"] == "prefill" else
            f"  | cold (first of a block) ours {ms(r['ours_cold_ms'])} transformers {ms(r['theirs_cold_ms'])} "
            f"ratio {times(r['ratio_cold'])} share {r['roofline_share_cold']:5.1%}")
    return (f"[{name}] {label:11}: ours {r['ours_ms']:8.2f} ms (best {r['ours_best_ms']:.2f}, max "
            f"{r['ours_max_ms']:.2f}, {r['steady_steps']} steps)  transformers {ms(r['theirs_ms'])}  "
          f"ratio {times(r['ratio'])}  roofline {r['roofline_ms']:7.2f} ms "
          f"({r['bound']}-bound: {r['gflop']:.2f} GFLOP, {r['mbytes']:.0f} MB; best of its {r['probes']} probes "
          f"{r['gemm_gflops']:.1f} GFLOP/s ({r['gemm_library']}), {r['read_gbs']:.1f} GB/s)  "
          f"share ours {r['roofline_share']:5.1%} (median/median {r['roofline_share_median']:5.1%}) "
          f"transformers {their_share}" + cold
          + ("" if r["gemms_only_ms"] is None else
             f"  | its GEMMs alone {r['gemms_only_ms']:7.2f} ms = {r['gemms_only_share']:5.1%} of the roofline"))
