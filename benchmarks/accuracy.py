"""Prediction accuracy: ckpt-tune's predicted peak against an independent allocator measurement.

For each example model, three batch sizes and three plans (no checkpointing, every block, and the
planner's plan for a budget halfway between those two), compare with the harness-measured peak
(common.measured_peak: a fresh model, its own checkpoint wrapper, CPU allocator events):

- `predicted`: the memory model on terms probed at that batch (`Searcher.terms(b)` + `predict`), what
  `search` rests its final answer on;
- `fitted`: the same on terms fitted as a line through batches 1 and 4 (`Terms.interpolate`), what
  `search` uses to guess the batch before re-probing; batch 8 and 16 are extrapolations;
- `profile`: `ckpt_tune.profile(...).peak_bytes` (what `ckpt-tune profile` reports) against the
  harness's no-checkpointing peak.

    .venv/bin/python benchmarks/accuracy.py [--models gpt,resnet] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import (
    EXAMPLES,
    example,
    md_table,
    measured_peak,
    mib,
    pct,
    plain,
    tool_searcher,
    write_results,
)
from ckpt_tune import Settings
from ckpt_tune import profile as tool_profile
from ckpt_tune.tune.memory_model import predict
from ckpt_tune.tune.planner import solve

BATCHES = {"gpt": (2, 4, 8), "resnet": (4, 8, 16), "unet": (2, 4, 8), "hf_gpt2": (1, 2, 4)}
QUICK = {"gpt": (2, 4), "resnet": (4, 8), "unet": (2, 4), "hf_gpt2": (1, 2)}
FIT = (1, 4)  # the batch sizes search fits its line through


def run_model(name: str, batches: tuple[int, ...]) -> tuple[list[dict], list[dict]]:
    ex = example(name)
    s = tool_searcher(ex.spec)
    s.order_units(min(batches))
    units = s.units
    n = len(units)
    t_fit = (s.terms(FIT[0]), s.terms(FIT[1]))
    rows, prof_rows = [], []
    for b in batches:
        t = s.terms(b)
        fitted = t_fit[0].interpolate(t_fit[1], b) if b not in FIT else t
        none, every = (0,) * n, (1,) * n
        p_none, p_all = predict(t, none), predict(t, every)
        budget = (p_none + p_all) // 2
        sol = solve(t, s.costs(b), budget)
        plans = [("none", none), ("every block", every)]
        if sol is not None:
            plans.append(("planner @ midpoint", sol.choice))
        for label, choice in plans:
            names = list(plain(t.names(choice)))
            measured = measured_peak(ex, b, checkpoint=names)
            pred, fit = predict(t, choice), predict(fitted, choice)
            row = {
                "model": name,
                "batch": b,
                "plan": label,
                "checkpointed": names,
                "budget_bytes": budget if label.startswith("planner") else None,
                "predicted_bytes": pred,
                "fitted_bytes": fit,
                "measured_bytes": measured,
                "error": (pred - measured) / measured,
                "fitted_error": (fit - measured) / measured,
            }
            rows.append(row)
            print(f"{name:8} b={b:<3} {label:18} ckpt={len(names)}/{n} predicted {mib(pred)} MiB "
                  f"fitted {mib(fit)} measured {mib(measured)}  err {pct(row['error'])} fit-err {pct(row['fitted_error'])}",
                  flush=True)
        prof = tool_profile(ex.spec, batch_size=b, settings=Settings(device="cpu"), scaling=False)
        truth = next(r["measured_bytes"] for r in rows if r["batch"] == b and r["plan"] == "none")
        prof_rows.append({"model": name, "batch": b, "profile_bytes": prof.peak_bytes, "measured_bytes": truth,
                          "error": (prof.peak_bytes - truth) / truth})
        print(f"{name:8} b={b:<3} profile peak {mib(prof.peak_bytes)} MiB vs measured {mib(truth)}  err {pct(prof_rows[-1]['error'])}", flush=True)
    s.runner.__exit__(None, None, None)
    return rows, prof_rows


def summary(errors: list[float]) -> dict[str, float]:
    a = [abs(e) for e in errors]
    return {"median_abs": statistics.median(a), "max_abs": max(a), "worst_signed": max(errors, key=abs), "n": len(a)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(EXAMPLES))
    ap.add_argument("--quick", action="store_true", help="two batch sizes per model")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (memory does not depend on it)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows, prof_rows = [], []
    for name in args.models.split(","):
        r, p = run_model(name, (QUICK if args.quick else BATCHES)[name])
        rows += r
        prof_rows += p
    summ = {
        "predicted": summary([r["error"] for r in rows]),
        "fitted": summary([r["fitted_error"] for r in rows]),
        "profile": summary([r["error"] for r in prof_rows]),
    }
    per_model = {
        m: {k: summary([r[k] for r in rows if r["model"] == m]) for k in ("error", "fitted_error")}
        for m in dict.fromkeys(r["model"] for r in rows)
    }
    elapsed = time.perf_counter() - t0
    table = md_table(
        ["model", "batch", "plan", "ckpt blocks", "predicted MiB", "measured MiB", "predicted - measured", "error",
         "fitted (b=1,4) MiB", "fitted error"],
        [[r["model"], r["batch"], r["plan"], len(r["checkpointed"]), mib(r["predicted_bytes"]), mib(r["measured_bytes"]),
          f"{r['predicted_bytes'] - r['measured_bytes']:+,} B", pct(r["error"]), mib(r["fitted_bytes"]), pct(r["fitted_error"])]
         for r in rows],
    )
    ptable = md_table(
        ["model", "batch", "`ckpt-tune profile` MiB", "measured MiB", "profile - measured", "error"],
        [[r["model"], r["batch"], mib(r["profile_bytes"]), mib(r["measured_bytes"]),
          f"{r['profile_bytes'] - r['measured_bytes']:+,} B", pct(r["error"])] for r in prof_rows],
    )
    stable = md_table(
        ["prediction", "cases", "median abs. error", "max abs. error", "worst (signed)"],
        [[k, v["n"], f"{100 * v['median_abs']:.2f}%", f"{100 * v['max_abs']:.2f}%", pct(v["worst_signed"])] for k, v in summ.items()],
    )
    mtable = md_table(
        ["model", "median abs. error (probed)", "max abs. error (probed)", "median abs. error (fitted)", "max abs. error (fitted)"],
        [[m, f"{100 * v['error']['median_abs']:.2f}%", f"{100 * v['error']['max_abs']:.2f}%",
          f"{100 * v['fitted_error']['median_abs']:.2f}%", f"{100 * v['fitted_error']['max_abs']:.2f}%"] for m, v in per_model.items()],
    )
    body = "\n\n".join([
        "Predicted peak (ckpt-tune's memory model) against the peak measured by an independent harness "
        "(fresh model, own checkpoint wrapper, CPU allocator events from torch.profiler; benchmarks/common.py). "
        "Error = (predicted - measured) / measured; positive means the tool over-estimates (safe side). "
        "`predicted`: terms probed at that batch (what search's answer rests on); `fitted`: terms on the line "
        "through batches 1 and 4 (what search uses to guess); `profile`: the peak `ckpt-tune profile` reports. "
        f"Plans: no checkpointing, every block, and the planner's plan for a budget halfway between the two. "
        f"Ran in {elapsed:.0f} s.",
        "## Summary", stable, "## Per model", mtable, "## Every case", table, "## `ckpt-tune profile`", ptable,
    ])
    print(stable)
    write_results("accuracy", "Prediction accuracy", {"summary": summ, "per_model": per_model, "rows": rows,
                  "profile_rows": prof_rows, "elapsed_s": elapsed}, body)


if __name__ == "__main__":
    main()
