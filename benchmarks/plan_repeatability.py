"""The planner's step-time error over several runs of benchmarks/plan_vs_measured.py, and how far the measured steps
themselves repeat from run to run on this machine.

One run of plan_vs_measured times each layout once (a median over rounds) in one quarter hour of a shared machine.
Its worst row moves from run to run (tp2, cp2-tp2, ep2, dp4-zero2, dp2-zero1, ...), so one run cannot tell a term
the planner gets wrong from a step that measured long or short that quarter hour. This script reads the rows of
several runs (each run's --json, replayed at the current code first so that one planner predicts them all:
`plan_vs_measured.py --replay RUN.json --json NOW.json`) and reports three things.

1. Each run's summary: median and worst error, rows within 10%, Kendall tau over the largest world size.
2. The measurement's own repeatability. A run's machine is faster or slower as a whole (its drift: per world
   size, the median over layouts of a layout's measured step over that layout's median across the runs; each run
   measures its own rates, so the planner follows it). What is left once the drift is divided out is each
   layout's deviation: how far its step moved between runs for reasons no description of the machine carries.
   If that deviation reaches 20% in a run, no fixed prediction is within 20% of every row of every run.
3. Each world size's signed median error in each run (a whole world running long or short of the planner), its
   mean over the runs, flagged as biased as below: a drift one run shows is that run's, one every run shows is a
   term the model misses for that world size.
4. Each layout's error across the runs: its median (the planner against a step measured that many times), mean
   and standard deviation, the bias flagged where the mean is over twice its standard error. The per-layout
   medians are summarised as one run is (median, within 10% and 20%, worst; tau between the layouts' median
   predicted and median measured steps on the largest world size, and how much slower the predicted best
   measures than the measured best).

    python benchmarks/plan_repeatability.py NOW1.json NOW2.json ...
    python benchmarks/plan_repeatability.py docs/data/plan-vs-measured-runs.json   # the stored runs of docs/planner.md
    python benchmarks/plan_repeatability.py NOW1.json NOW2.json --compact runs.json # store them in that form

A file is one run's rows (a list, as plan_vs_measured writes it; the run is named by the file) or several runs'
(`{"runs": {name: rows}}`, as --compact writes it). Only layouts every run measured are compared. Prints
RESULT name=plan_repeatability runs=N layouts=M median_abs_error=... within_10pct=... within_20pct=...
       worst_abs_error=... kendall_tau=... best_gap=... run_worst_min=... run_worst_max=...
       deviation_median=... deviation_p90=... deviation_worst=...
(the first six over the layouts' median errors; run_worst_*: the range of the runs' own worst errors;
deviation_*: the measured steps' deviations once each run's drift is divided out, over every row of every run).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from plan_vs_measured import rank_order, world_medians  # noqa: E402  (torch-free)

ROW_KEYS = ("name", "world_size", "measured", "predicted")
Key = tuple[int, str]  # (world size, layout name)


def load_runs(paths: list[str]) -> dict[str, list[dict]]:
    """{run name: rows} from plan_vs_measured --json files (one run each) or --compact files (several); every row's
    seconds a positive finite number and its world size a positive integer."""
    runs: dict[str, list[dict]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        found = data["runs"] if isinstance(data, dict) and "runs" in data else {Path(path).stem: data}
        for name, rows in found.items():
            if not isinstance(rows, list) or not rows:
                raise ValueError(f"{path}: run {name!r} holds no rows (a list of plan_vs_measured's --json rows)")
            for row in rows:
                where = f"{path}: run {name!r}, row {row.get('name', '?')!r}" if isinstance(row, dict) else path
                missing = [key for key in ROW_KEYS if not isinstance(row, dict) or key not in row]
                if missing:
                    raise ValueError(f"{where} lacks {', '.join(missing)} (write rows with plan_vs_measured.py "
                                     "--json, or --replay RUN.json --json NOW.json)")
                bad = [key for key in ("measured", "predicted") if isinstance(row[key], bool)
                       or not isinstance(row[key], (int, float)) or not math.isfinite(row[key]) or row[key] <= 0]
                if bad or isinstance(row["world_size"], bool) or not isinstance(row["world_size"], int) \
                        or row["world_size"] < 1:
                    raise ValueError(f"{where}: measured and predicted must be positive finite seconds and world_size "
                                     f"a positive integer; found {', '.join(f'{k} = {row[k]!r}' for k in ROW_KEYS[1:])}")
            if name in runs:
                raise ValueError(f"{path}: run {name!r} given twice")
            runs[name] = [{key: row[key] for key in ROW_KEYS} | {"machine": row.get("machine", "not recorded")}
                          for row in rows]
    return runs


def common_layouts(runs: dict[str, list[dict]]) -> list[Key]:
    """(world size, name) of the layouts every run measured, in the first run's order."""
    first = next(iter(runs.values()))
    every = set.intersection(*({(r["world_size"], r["name"]) for r in rows} for rows in runs.values()))
    return [(r["world_size"], r["name"]) for r in first if (r["world_size"], r["name"]) in every]


def deviations(steps: dict[str, dict[Key, float]]) -> dict[str, dict[Key, float]]:
    """Each run's measured step of each layout over the layout's median across runs, divided by the run's drift at
    that world size (the median of those ratios over its layouts), less 1 (steps: {run: {layout: seconds}})."""
    layouts = list(next(iter(steps.values())))
    median = {key: statistics.median(run[key] for run in steps.values()) for key in layouts}
    out = {}
    for run, mine in steps.items():
        ratio = {key: mine[key] / median[key] for key in layouts}
        drift = {w: statistics.median(r for (world, _), r in ratio.items() if world == w) for w, _ in layouts}
        out[run] = {key: ratio[key] / drift[key[0]] - 1 for key in layouts}
    return out


def summary(errs: dict[Key, float], predicted: dict[Key, float], measured: dict[Key, float]) -> dict:
    """Median and worst absolute error `errs`, rows within 10% and 20%, the worst row, and (plan_vs_measured's
    `rank_order`) Kendall tau between `predicted` and `measured` and the predicted best's gap over the largest world
    size's layouts."""
    absolute = [abs(e) for e in errs.values()]
    worst = max(errs, key=lambda k: abs(errs[k]))
    top = [key for key in errs if key[0] == max(w for w, _ in errs)]
    tau, _, gap = rank_order([{"measured": measured[k]} for k in top], [predicted[k] for k in top])
    return {"median_abs_error": statistics.median(absolute), "within_10pct": sum(e <= 0.10 for e in absolute),
            "within_20pct": sum(e <= 0.20 for e in absolute), "worst_abs_error": max(absolute),
            "worst_error": errs[worst], "worst_layout": worst[1], "kendall_tau": tau, "best_gap": gap}


def world_drifts(errs: dict[str, dict[Key, float]]) -> dict[int, dict]:
    """Per world size: each run's signed median error over its layouts (how far the world's steps as a whole ran
    from the planner), their mean and standard deviation over the runs, and whether the world is biased (|mean|
    over twice its standard error): a drift of one run is the machine's, a drift every run shares is the model's."""
    per_run = [world_medians(run) for run in errs.values()]
    out = {}
    for w in per_run[0]:
        medians = [run[w] for run in per_run]
        mean, sd = statistics.fmean(medians), statistics.stdev(medians)
        out[w] = {"per_run": medians, "mean": mean, "sd": sd, "biased": abs(mean) > 2 * sd / math.sqrt(len(medians))}
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-quantile by the nearest rank (no interpolation)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def analyse(runs: dict[str, list[dict]]) -> dict:
    """Every figure the report prints (see the module docstring)."""
    if len(runs) < 2:
        raise ValueError(f"{len(runs)} run given: repeatability needs two or more")
    layouts = common_layouts(runs)
    if not layouts:
        raise ValueError("no layout was measured by every run")
    rows = {run: {(r["world_size"], r["name"]): r for r in mine} for run, mine in runs.items()}
    seconds = {kind: {run: {key: rows[run][key][kind] for key in layouts} for run in runs}
               for kind in ("predicted", "measured")}
    devs = deviations(seconds["measured"])
    errs = {run: {key: seconds["predicted"][run][key] / seconds["measured"][run][key] - 1 for key in layouts}
            for run in runs}
    per_run = {run: summary(errs[run], seconds["predicted"][run], seconds["measured"][run]) for run in runs}
    for run, s in per_run.items():
        worst = max(devs[run], key=lambda k: abs(devs[run][k]))
        s.update(deviation_median=statistics.median(abs(d) for d in devs[run].values()),
                 deviation_worst=devs[run][worst], deviation_worst_layout=worst[1])
    layout_rows = []
    for key in layouts:
        values = [errs[run][key] for run in runs]
        sd, mean = statistics.stdev(values), statistics.fmean(values)
        layout_rows.append({"world_size": key[0], "name": key[1], "median": statistics.median(values), "mean": mean,
                            "sd": sd, "min": min(values), "max": max(values),
                            "biased": abs(mean) > 2 * sd / math.sqrt(len(values)),
                            "deviation_sd": statistics.pstdev(devs[run][key] for run in runs)})
    # the layouts' median errors, with tau between their median predicted and median measured steps
    median = {kind: {key: statistics.median(by_run[key] for by_run in seconds[kind].values()) for key in layouts}
              for kind in seconds}
    together = summary({(r["world_size"], r["name"]): r["median"] for r in layout_rows}, median["predicted"],
                       median["measured"])
    every = [abs(d) for run in devs.values() for d in run.values()]
    return {"layouts": layout_rows, "runs": per_run, "together": together, "worlds": world_drifts(errs),
            "deviation": {"median": statistics.median(every), "p90": percentile(every, 0.9), "worst": max(every)}}


def report(runs: dict[str, list[dict]], result: dict, top: int) -> str:
    lines = [f"# {len(runs)} runs, {len(result['layouts'])} layouts measured by each"]
    lines.append(f"# {'run':<26}{'median':>8}{'<=10%':>7}{'worst':>9}  {'(layout)':<20}{'tau':>6}"
                 f"{'dev median':>12}{'dev worst':>11}  (layout)")
    for run, s in result["runs"].items():
        lines.append(f"  {run:<26}{100 * s['median_abs_error']:>7.1f}%{s['within_10pct']:>7}"
                     f"{100 * s['worst_error']:>+8.1f}%  {s['worst_layout']:<20}{s['kendall_tau']:>6.3f}"
                     f"{100 * s['deviation_median']:>11.1f}%{100 * s['deviation_worst']:>+10.1f}%  "
                     f"{s['deviation_worst_layout']}")
    d = result["deviation"]
    lines.append(f"# the measured steps, each run's drift per world size divided out, deviate from their median over "
                 f"the runs by a median {100 * d['median']:.1f}%, 90th percentile {100 * d['p90']:.1f}%, worst "
                 f"{100 * d['worst']:.1f}%")
    lines.append("# each world size's signed median error per run (mean over the runs; * = biased: |mean| over twice "
                 "its standard error): " + "; ".join(
                     f"{w} rank{'s' if w > 1 else ''}{'*' if x['biased'] else ''} "
                     + " ".join(f"{100 * m:+.1f}%" for m in x["per_run"]) + f" (mean {100 * x['mean']:+.1f}%)"
                     for w, x in result["worlds"].items()))
    lines.append(f"# per layout over the runs (the {top} largest median errors; * = biased: |mean| over twice its "
                 "standard error):")
    lines.append(f"# {'layout':<22}{'ranks':>6}{'median':>9}{'mean':>8}{'sd':>7}{'min':>8}{'max':>8}{'meas. sd':>10}")
    ordered = sorted(result["layouts"], key=lambda r: -abs(r["median"]))
    for r in ordered[:top]:
        lines.append(f"  {r['name'] + ('*' if r['biased'] else ''):<22}{r['world_size']:>6}{100 * r['median']:>+8.1f}%"
                     f"{100 * r['mean']:>+7.1f}%{100 * r['sd']:>6.1f}%{100 * r['min']:>+7.1f}%{100 * r['max']:>+7.1f}%"
                     f"{100 * r['deviation_sd']:>9.1f}%")
    t = result["together"]
    n = len(result["layouts"])
    lines.append(f"# the layouts' median errors over the runs: median {100 * t['median_abs_error']:.1f}%, "
                 f"{t['within_10pct']} of {n} within 10%, {t['within_20pct']} within 20%, worst "
                 f"{100 * t['worst_abs_error']:.1f}%; tau {t['kendall_tau']:.3f} between the median predicted and "
                 f"median measured steps on the largest world size, the predicted best {100 * t['best_gap']:.1f}% "
                 "over the measured best")
    worsts = [abs(s["worst_error"]) for s in result["runs"].values()]
    lines.append(f"RESULT name=plan_repeatability runs={len(runs)} layouts={n} "
                 f"median_abs_error={t['median_abs_error']:.4f} within_10pct={t['within_10pct']} "
                 f"within_20pct={t['within_20pct']} worst_abs_error={t['worst_abs_error']:.4f} "
                 f"kendall_tau={t['kendall_tau']:.4f} best_gap={t['best_gap']:.4f} run_worst_min={min(worsts):.4f} "
                 f"run_worst_max={max(worsts):.4f} deviation_median={d['median']:.4f} deviation_p90={d['p90']:.4f} "
                 f"deviation_worst={d['worst']:.4f}")
    return "\n".join(lines)


def compact(runs: dict[str, list[dict]]) -> str:
    """The runs as {"runs": {name: rows}}, a row per line (a diff shows which rows a new run changed)."""
    def short(row: dict) -> dict:  # seconds to 6 significant digits: a microsecond of a 0.1 s step
        return {key: float(f"{value:.6g}") if isinstance(value, float) else value for key, value in row.items()}

    blocks = [f"  {json.dumps(run)}: [\n" + ",\n".join(f"    {json.dumps(short(row))}" for row in rows) + "\n  ]"
              for run, rows in runs.items()]
    return '{"runs": {\n' + ",\n".join(blocks) + "\n}}\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="plan_vs_measured --json rows (one run each) or --compact files")
    parser.add_argument("--top", type=int, default=12, help="layouts listed, by the size of their median error")
    parser.add_argument("--compact", help="also write the runs here as {\"runs\": {name: rows}}, each row's name, "
                                          "world size, measured and predicted seconds and machine only")
    args = parser.parse_args()
    try:
        runs = load_runs(args.files)
        result = analyse(runs)
    except (OSError, ValueError, KeyError, TypeError) as error:
        parser.error(str(error))
    print(report(runs, result, args.top))
    if args.compact:
        Path(args.compact).write_text(compact(runs))
        print(f"wrote {args.compact}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
