"""Batch finding: `ckpt-tune search` against a trial-and-error finder, at a budget that needs checkpointing.

The trial-and-error finder reimplements Lightning's `Tuner.scale_batch_size` (lightning/pytorch/tuner/
batch_size_scaling.py): start at `init_val=2`, run `steps_per_trial=3` training steps per trial, and
- "power": double after each success; on the first OOM after a success, halve and stop;
- "binsearch": double until an OOM, then bisect between the last success and the failure.
There is no GPU here, so a step "OOMs" when the harness-measured peak (common.measured_peak, the
steady-state iteration of a fresh model) exceeds the budget. The finder's wall time counts only its
real training steps (plain steps, no profiler), as on a GPU where an OOM costs nothing to detect: a
lower bound on what it costs there. It runs twice: with every block checkpointed (what a user who
needs memory would do) and without checkpointing.

ckpt-tune's time is `ckpt_tune.search(target, vram=...)` end to end (probes, planning,
verification, frontier), in the same process. Finally each configuration found is timed (interleaved
steps) to compare training throughput: samples per second at the batch and plan found.

    .venv/bin/python benchmarks/batch_finder.py [--model gpt] [--vram 160MiB,320MiB]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import (
    TimedModel,
    example,
    interleaved_times,
    md_table,
    measured_peak,
    mib,
    plain,
    write_results,
)
from ckpt_tune import Settings, search
from ckpt_tune.measure.device import parse_budget
from ckpt_tune.tune.candidates import find_blocks

STEPS_PER_TRIAL = 3  # Lightning's default
INIT_VAL = 2  # Lightning's default
MAX_TRIALS = 25  # Lightning's default


class Finder:
    """Lightning's scale_batch_size over real CPU steps with a simulated OOM."""

    def __init__(self, ex, budget: int, checkpoint: tuple[str, ...]) -> None:
        self.ex, self.budget, self.checkpoint = ex, budget, checkpoint
        self.steps = 0
        self.trials: list[tuple[int, bool]] = []
        self.step_seconds = 0.0
        self._peaks: dict[int, int] = {}

    def trial(self, b: int) -> bool:
        """Run steps_per_trial real steps at batch b; True if they fit the budget."""
        if b not in self._peaks:  # the simulated OOM check: not timed (on a GPU it is free)
            self._peaks[b] = measured_peak(self.ex, b, checkpoint=self.checkpoint)
        ok = self._peaks[b] <= self.budget
        t0 = time.perf_counter()
        m = TimedModel(self.ex, checkpoint=self.checkpoint)
        for _ in range(STEPS_PER_TRIAL):
            m.step(b)
            self.steps += 1
        self.step_seconds += time.perf_counter() - t0
        self.trials.append((b, ok))
        return ok

    def power(self) -> int:
        size, any_success = INIT_VAL, False
        for _ in range(MAX_TRIALS):
            if self.trial(size):
                size, any_success = size * 2, True
            else:
                size = max(1, int(size * 0.5))
                if any_success:
                    break
        return size

    def binsearch(self) -> int:
        size, low, high, count = INIT_VAL, 1, None, 0
        while True:
            if self.trial(size):
                count += 1
                if count > MAX_TRIALS:
                    break
                low = size
                if high:
                    if high - low <= 1:
                        break
                    size = (high + low) // 2
                else:
                    size *= 2
            else:
                high = size
                size = (high + low) // 2
                if high - low <= 1:
                    break
        return size


def run_budget(ex, vram: str, blocks: tuple[str, ...], repeats: int) -> dict:
    budget = parse_budget(vram, "cpu", None).usable_bytes
    t0 = time.perf_counter()
    outcome = search(ex.spec, vram=vram, settings=Settings(device="cpu"))
    tool_s = time.perf_counter() - t0
    plan = outcome.plan
    checkpoint = plain(plan.checkpoint)
    tool_peak = measured_peak(ex, plan.batch_size, checkpoint=checkpoint)
    rows = [{
        "finder": "ckpt-tune search", "batch": plan.batch_size, "checkpointed": list(checkpoint),
        "wall_s": tool_s, "steps": outcome.result.probes, "trials": None, "measured_bytes": tool_peak,
        "fits": tool_peak <= budget, "note": "recorded steps (probes + verification); wall time end to end",
    }]
    # search probes every plan of probe_configs (no checkpointing included) at the batch it answers: what did
    # its own recorded steps peak at, against the budget it was given?
    base = outcome.result.baselines.get("no checkpointing")
    probe_peak = base.predicted_peak if base else None
    print(f"{vram}: ckpt-tune: batch {plan.batch_size}, {_checkpointed(checkpoint, len(blocks))} blocks, {tool_s:.1f} s, "
          f"{outcome.result.probes} recorded steps; harness peak {mib(tool_peak)} MiB of {mib(budget)}", flush=True)
    configs = {"ckpt-tune search": (plan.batch_size, checkpoint)}
    for ck_label, ck in (("every block", blocks), ("no checkpointing", ())):
        for mode in ("power", "binsearch"):
            f = Finder(ex, budget, ck)
            t0 = time.perf_counter()
            b = getattr(f, mode)()
            total = time.perf_counter() - t0
            peak = measured_peak(ex, b, checkpoint=ck)
            label = f"Lightning {mode}, {ck_label}"
            rows.append({
                "finder": label, "batch": b, "checkpointed": list(ck), "wall_s": f.step_seconds, "steps": f.steps,
                "trials": f.trials, "measured_bytes": peak, "fits": peak <= budget,
                "note": f"wall time of its training steps only; with the simulated OOM checks {total:.1f} s",
            })
            configs[label] = (b, ck)
            print(f"{vram}: {label}: batch {b}, {f.steps} steps in {len(f.trials)} trials {f.trials}, "
                  f"{f.step_seconds:.1f} s of steps", flush=True)
    # throughput of what each found: samples per second, all configurations interleaved
    distinct = {cfg: TimedModel(ex, checkpoint=cfg[1]) for cfg in dict.fromkeys(configs.values())}
    med = interleaved_times(distinct, {cfg: cfg[0] for cfg in distinct}, repeats)
    for r in rows:
        cfg = configs[r["finder"]]
        r["step_s"] = med[cfg]
        r["samples_per_s"] = cfg[0] / med[cfg]
        r["time_ratio_vs_ckpt_tune"] = r["wall_s"] / tool_s
    return {"vram": vram, "budget_bytes": budget, "rows": rows, "ckpt_tune_no_checkpointing_probe_bytes": probe_peak}


def _checkpointed(entries, n: int) -> str:
    """`4/6`, or `6/6 in 2 segments` when a plan checkpoints runs of blocks as one."""
    segs = sum(1 for e in entries if not isinstance(e, str))
    count = sum(1 if isinstance(e, str) else len(e) for e in entries)
    return f"{count}/{n}" + (f" in {segs} segment{'s' if segs > 1 else ''}" if segs else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--vram", default="160MiB,320MiB", help="budgets, comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timed steps per configuration found")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable timings on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ex = example(args.model)
    blocks = tuple(find_blocks(ex.build()))
    runs = [run_budget(ex, v, blocks, args.repeats) for v in args.vram.split(",")]
    parts = [
        f"Model `{ex.spec}`, {args.threads} torch thread(s). "
        "ckpt-tune: `api.search` end to end; its steps are recorded (profiled) steps. Lightning finders: "
        f"init_val {INIT_VAL}, steps_per_trial {STEPS_PER_TRIAL}, max_trials {MAX_TRIALS}; a trial OOMs when the harness-measured "
        "peak exceeds the budget; their wall time counts only their real training steps (a lower bound on a GPU, "
        "where each OOM also costs a crash and recovery). Samples/s: median of interleaved steps of each "
        "configuration found (noisy on a shared machine; compare within one table only).",
    ]
    for run in runs:
        rows = run["rows"]
        parts += [
            f"## Budget {run['vram']} ({run['budget_bytes']:,} bytes)",
            md_table(
                ["finder", "batch found", "blocks checkpointed", "measured peak MiB", "fits", "steps run", "wall time",
                 "time / ckpt-tune's", "samples/s at the result"],
                [[r["finder"], r["batch"], _checkpointed(r["checkpointed"], len(blocks)), mib(r["measured_bytes"]),
                  "yes" if r["fits"] else "NO", r["steps"], f"{r['wall_s']:.1f} s", f"{r['time_ratio_vs_ckpt_tune']:.2f}",
                  f"{r['samples_per_s']:.1f}"] for r in rows],
            ),
            "Trials (batch, fit?): " + "; ".join(f"{r['finder']}: {r['trials']}" for r in rows if r["trials"]),
        ]
        probe = run["ckpt_tune_no_checkpointing_probe_bytes"]
        if probe and probe > run["budget_bytes"]:
            parts.append(
                f"ckpt-tune's own probes at batch {rows[0]['batch']} include a step without checkpointing, which peaked at "
                f"{mib(probe)} MiB, {probe / run['budget_bytes']:.2f}x the budget: on a device of exactly this size that "
                "probe would run out of memory (see benchmarks/README.md)."
            )
    body = "\n\n".join(parts)
    print(body)
    write_results("batch_finder", "Batch finding: ckpt-tune search vs trial and error",
                  {"model": ex.spec, "threads": args.threads, "budgets": runs}, body)


if __name__ == "__main__":
    main()
