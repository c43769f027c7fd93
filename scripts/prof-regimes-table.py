#!/usr/bin/env python3
"""The table of scripts/prof-regimes.sh runs: one Markdown row per regime, each cell the runs'
values in the order given (prof-regimes.sh ends with its own run's; docs/benchmarks.md#strata-prof
keeps these tables).

    scripts/prof-regimes-table.py WORK_DIR [WORK_DIR ...]

Each WORK_DIR is a prof-regimes.sh work folder: its <regime>.json, the JSON strata-prof printed.
Below the table, per run: the drive's figures the nvme regime measured, and how far the drive
slowed under compute in each round (the same figures docs/strata-prof.md#measure names); and per
regime the host's memory rate as profiled over its median beside the validation runs, and the
drive's probe and the kernels' timing likewise (speeds: a run profiled on a machine, a drive or
kernels at another speed shows there; a regime without the drive in its validated runs, or an older
run, shows "-"). A
recommendation that is not the fastest prediction (of near-ties, one that keeps the NVMe drive
markedly less busy) says "(over #K)", K the fastest prediction's rank.
"""
import json
import os
import sys

REGIMES = ["compute", "link", "nvme", "offload"]


def pct(x):
    return f"{x * 100:.1f}%"


def load(run, regime):
    path = os.path.join(run, regime + ".json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"prof-regimes-table: {path}: {e}: give the work folder of a finished "
                 "scripts/prof-regimes.sh run")


def row(regime, runs):
    cells = {k: [] for k in ["bound", "pred", "meas", "err", "rho", "rec", "drift"]}
    for run in runs:
        j = load(run, regime)
        if not j.get("candidates") or j["candidates"][0].get("measured_step_s") is None:
            sys.exit(f"prof-regimes-table: {run}/{regime}.json has no validated candidate: "
                     "prof-regimes.sh runs strata-prof with --validate")
        c = j["candidates"][0]
        cells["bound"].append(f'{c["bottleneck"]} / {c.get("measured_bottleneck") or "-"}')
        cells["pred"].append(f'{c["predicted_step_s"] * 1e3:.1f}')
        cells["meas"].append(f'{c["measured_step_s"] * 1e3:.1f}')
        fit = f' ({j["candidates_feasible"]} fit)' if regime == "offload" else ""
        cells["err"].append(f'{pct(j["worst_prediction_error"])} of {j["validated"]}{fit}')
        rho, resolved = j.get("rank_correlation_spearman"), j.get("rank_correlation_spearman_resolved")
        f2 = lambda v: "-" if v is None else f"{v:.2f}"
        cells["rho"].append(f'{f2(rho)} / {f2(resolved)} ({pct(j.get("rank_tie_resolution") or 0)})')
        rec = j["recommended_vs_best_measured"] - 1
        # Recommended over the fastest prediction among near-ties (recommend_less_drive_bound).
        over = j.get("fastest_predicted_rank") or 1
        cells["rec"].append(("fastest" if rec < 5e-4 else f"+{pct(rec)}") +
                            (f" (over #{over})" if over > 1 else ""))
        drift = j.get("round_drift")  # (older runs' JSON has none: "-", not a drift of 0)
        cells["drift"].append("-" if drift is None else pct(drift))
    bound = cells["bound"][0] if len(set(cells["bound"])) == 1 else ", ".join(cells["bound"])
    cols = [regime, bound] + [", ".join(cells[k]) for k in ["pred", "meas", "err", "rho", "rec", "drift"]]
    return "| " + " | ".join(cols) + " |"


def main():
    runs = sys.argv[1:]
    if not runs or any(r in ("-h", "--help") for r in runs):
        print(__doc__.strip())
        sys.exit(0 if runs else 2)
    rows = [row(regime, runs) for regime in REGIMES]  # every file read before a line is printed
    print("| regime | bound by (predicted / measured) | predicted ms | measured ms | worst error "
          "| rank correlation | recommended vs fastest | drift |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    print()
    for run in runs:
        for what, key in (("host memory", "host_mem"), ("drive", "drive"),
                          ("kernels", "compute")):
            speed = lambda r: load(run, r).get(f"{key}_profile_vs_validation")
            print(f'{run}: {what} profiled / validating: ' + ", ".join(
                f'{r} {"-" if speed(r) is None else f"{speed(r):.2f}"}' for r in REGIMES))
        m = load(run, "nvme")["machine"]
        if m.get("nvme_read_gbps") is None:
            print(f"{run}: no drive measured (the nvme regime ran without NVMe)")
            continue
        ms = lambda k: "-" if m.get(k) is None or m[k] < 0 else f"{m[k]:.3f}"
        rounds = ", ".join(f"{x * 100:.0f}" for x in m.get("nvme_compute_slowdown_rounds") or [])
        print(f'{run}: nvme_subgroup_ms {ms("nvme_subgroup_ms")}, nvme_fetch_request_ms '
              f'{ms("nvme_fetch_request_ms")}, nvme_mixed_request_ms {ms("nvme_mixed_request_ms")} '
              f'(deep {ms("nvme_mixed_deep_request_ms")}), drive slowdown under compute '
              f'{(m.get("nvme_compute_slowdown") or 0) * 100:.0f}% ({rounds})')

if __name__ == "__main__":
    main()
