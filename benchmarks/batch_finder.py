"""Batch finding: `ckpt-tune search` against a trial-and-error finder, at a budget that needs checkpointing.

The trial-and-error finder reimplements Lightning's `Tuner.scale_batch_size` (lightning/pytorch/tuner/
batch_size_scaling.py): start at `init_val=2`, run `steps_per_trial=3` training steps per trial, and
- "power": double after each success; on the first OOM after a success, halve and stop;
- "binsearch": double until an OOM, then bisect between the last success and the failure.
There is no GPU here, so a trial "OOMs" when the harness-measured peak (common.measured_peak, the
steady-state iteration of a fresh model) exceeds the budget. It runs twice: with every block
checkpointed (what a user who needs memory would do) and without checkpointing.

What a trial is charged (its wall time), the rule:
- a trial that fits: its `steps_per_trial` real training steps (plain steps of a fresh model, no profiler);
- a trial that fails: what it costs on a GPU, where it dies inside its first step at the allocation that
  passes the budget: the time of one plain first step at that batch times the fraction of the step
  (profiled steady-state iteration, allocator event timestamps) that runs before live bytes first exceed
  the budget. At most one step. Crash recovery (freeing, `empty_cache`, rebuilding) is not charged.
The simulated OOM check itself (the harness run) is not charged, nor is torch's one-time initialisation
(the first optimizer a process builds imports torch._dynamo): it is done before the first finder runs.

ckpt-tune's time is `ckpt_tune.search(target, vram=...)` end to end (probes, planning, verification,
frontier), in the same process, as it runs here on CPU. Its steps are counted by wrapping
`StepRunner.iteration` (every step it runs: recorded, timed, warm-up) and `StepRunner.measure` (recorded
steps, with their peaks): recorded steps that peak above the budget are the ones that would run out of
memory on a device of that size (search then falls back to fitted terms; that path is not timed here).
Finally each configuration found is timed (interleaved steps): samples per second at the batch and plan.

    .venv/bin/python benchmarks/batch_finder.py [--model gpt,hf_gpt2,vit] [--vram 160MiB,320MiB] [--quick] [--allow-dirty]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.common import (
    TimedModel,
    example,
    harness,
    interleaved_times,
    md_table,
    measured_peak,
    mib,
    plain,
    write_results,
)
from ckpt_tune import Settings, search
from ckpt_tune.measure.device import parse_budget
from ckpt_tune.measure.runner import StepRunner
from ckpt_tune.tune.candidates import find_blocks

STEPS_PER_TRIAL = 3  # Lightning's default
INIT_VAL = 2  # Lightning's default
MAX_TRIALS = 25  # Lightning's default


def crossing_fraction(ex, b: int, checkpoint: tuple, budget: int) -> float:
    """Fraction of a steady-state iteration at batch b that runs before live bytes first exceed `budget`
    (1.0 if they never do). The harness's loop (tests/harness.py: profiler from before the warm-up, the
    second iteration measured, parameters and buffers as the starting bytes), read with timestamps."""
    model = ex.build()
    model.train()
    if checkpoint:
        harness.wrap_blocks(model, checkpoint)
    params = [p for p in model.parameters() if p.requires_grad]
    static = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                  for t in [*model.parameters(), *model.buffers()]}.values())
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            opt = harness.make_optimizer(params, "adamw")
            for i in range(2):
                if i == 1:
                    with record_function("finder::start"):
                        pass
                for p in params:
                    p.grad = None
                batch = ex.make_batch(b)
                loss = ex.loss_fn(model, batch)
                loss.backward()
                opt.step()
                del loss, batch
            with record_function("finder::end"):
                pass
    finally:
        gc.enable()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() in ("[memory]", "finder::start", "finder::end")),
                    key=lambda e: e.start_ns())
    live, t_start, t_cross, t_end = static, None, None, None
    for e in events:
        if e.name() == "finder::start":
            t_start = e.start_ns()
        elif e.name() == "finder::end":
            t_end = e.start_ns()
        elif e.device_type() == torch.autograd.DeviceType.CPU:
            live += e.nbytes()
            if t_start is not None and t_cross is None and live > budget:
                t_cross = e.start_ns()
    if t_start is None or t_end is None or t_cross is None or t_end <= t_start:
        return 1.0
    return min(1.0, max(0.0, (t_cross - t_start) / (t_end - t_start)))


class Finder:
    """Lightning's scale_batch_size over real CPU steps with a simulated OOM (charged as the docstring says)."""

    def __init__(self, ex, budget: int, checkpoint: tuple[str, ...]) -> None:
        self.ex, self.budget, self.checkpoint = ex, budget, checkpoint
        self.steps = 0  # full steps run by trials that fit
        self.failed_steps = 0  # first steps cut short by the simulated OOM
        self.trials: list[tuple[int, bool]] = []
        self.step_seconds = 0.0  # what the finder is charged
        self.full_step_seconds = 0.0  # the old rule: three full steps for every trial, failing or not
        self.charges: list[dict] = []
        self._peaks: dict[int, int] = {}

    def trial(self, b: int) -> bool:
        """Run the trial at batch b; True if it fits the budget."""
        if b not in self._peaks:  # the simulated OOM check: not charged (on a GPU the allocator does it)
            self._peaks[b] = measured_peak(self.ex, b, checkpoint=self.checkpoint)
        ok = self._peaks[b] <= self.budget
        m = TimedModel(self.ex, checkpoint=self.checkpoint)
        times = []
        for _ in range(STEPS_PER_TRIAL if ok else 1):
            times.append(m.step(b))
        if ok:
            self.steps += STEPS_PER_TRIAL
            charged = sum(times)
            self.full_step_seconds += charged
            self.charges.append({"batch": b, "fits": True, "charged_s": charged})
        else:
            frac = crossing_fraction(self.ex, b, self.checkpoint, self.budget)
            charged = frac * times[0]
            self.failed_steps += 1
            self.full_step_seconds += times[0] * STEPS_PER_TRIAL  # about: the old rule's three full steps
            self.charges.append({"batch": b, "fits": False, "first_step_s": times[0], "fraction_before_oom": frac,
                                 "charged_s": charged, "peak_bytes": self._peaks[b]})
        self.step_seconds += charged
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
    counts = {"iterations": 0, "recorded": 0, "recorded_over_budget": 0, "real_iterations": 0, "real_recorded": 0, "real_over_budget": 0}
    orig_iter, orig_measure = StepRunner.iteration, StepRunner.measure

    def iteration(self, batch_size, *a, **k):
        counts["iterations"] += 1
        counts["real_iterations"] += int(not self.fake)
        return orig_iter(self, batch_size, *a, **k)

    def measure(self, *a, **k):
        m = orig_measure(self, *a, **k)
        counts["recorded"] += 1
        counts["recorded_over_budget"] += int(m.peak_bytes > budget)
        if not self.fake:  # a real step: on a device of the budget's size, one over it is an OOM
            counts["real_recorded"] += 1
            counts["real_over_budget"] += int(m.peak_bytes > budget)
            counts["largest_real_peak"] = max(counts.get("largest_real_peak", 0), m.peak_bytes)
        return m

    StepRunner.iteration, StepRunner.measure = iteration, measure
    try:
        t0 = time.perf_counter()
        outcome = search(ex.spec, vram=vram, settings=Settings(device="cpu"))
        tool_s = time.perf_counter() - t0
    finally:
        StepRunner.iteration, StepRunner.measure = orig_iter, orig_measure
    plan = outcome.plan
    checkpoint = plain(plan.checkpoint)
    tool_peak = measured_peak(ex, plan.batch_size, checkpoint=checkpoint)
    rows = [{
        "finder": "ckpt-tune search", "batch": plan.batch_size, "checkpointed": list(checkpoint),
        "wall_s": tool_s, "steps": counts["iterations"], "failed_steps": 0, "recorded_steps": counts["recorded"],
        "recorded_over_budget": counts["recorded_over_budget"], "probes_reported": outcome.result.probes,
        # this process's steps only: the fake probes of forked processes are in probes_reported
        "real_steps": counts["real_iterations"], "real_recorded": counts["real_recorded"],
        "real_over_budget": counts["real_over_budget"], "largest_real_peak": counts.get("largest_real_peak"),
        "fake_recorded": outcome.result.probes - counts["real_recorded"],
        "trials": None, "measured_bytes": tool_peak, "fits": tool_peak <= budget,
        "note": "every step it ran (recorded, timed, warm-up); wall time end to end, as run on CPU",
    }]
    # search probes every plan of probe_configs (no checkpointing included) at the batch it answers: what did
    # its own recorded steps peak at, against the budget it was given?
    base = outcome.result.baselines.get("no checkpointing")
    probe_peak = base.predicted_peak if base else None
    print(f"{vram}: ckpt-tune: batch {plan.batch_size}, blocks checkpointed {_checkpointed(checkpoint, blocks)}, {tool_s:.1f} s, "
          f"{counts['real_iterations']} real steps ({counts['real_recorded']} recorded, {counts['real_over_budget']} of them over the budget), "
          f"{outcome.result.probes - counts['real_recorded']} recorded under fake tensors; "
          f"harness peak {mib(tool_peak)} MiB of {mib(budget)}", flush=True)
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
                "failed_steps": f.failed_steps, "old_rule_s": f.full_step_seconds, "charges": f.charges,
                "trials": f.trials, "measured_bytes": peak, "fits": peak <= budget,
                "note": f"charged: steps of trials that fit, failing trials up to the failing allocation; "
                        f"with the simulated OOM checks {total:.1f} s",
            })
            configs[label] = (b, ck)
            print(f"{vram}: {label}: batch {b}, {f.steps} steps + {f.failed_steps} failed in {len(f.trials)} trials {f.trials}, "
                  f"{f.step_seconds:.1f} s charged (old rule {f.full_step_seconds:.1f} s)", flush=True)
    # throughput of what each found: samples per second, all configurations interleaved
    distinct = {cfg: TimedModel(ex, checkpoint=cfg[1]) for cfg in dict.fromkeys(configs.values())}
    med = interleaved_times(distinct, {cfg: cfg[0] for cfg in distinct}, repeats)
    for r in rows:
        cfg = configs[r["finder"]]
        r["step_s"] = med[cfg]
        r["samples_per_s"] = cfg[0] / med[cfg]
        r["time_ratio_vs_ckpt_tune"] = r["wall_s"] / tool_s
    # what the search cost, in plain training steps of the plan it reports
    rows[0]["search_in_plan_steps"] = tool_s / med[configs["ckpt-tune search"]]
    return {"vram": vram, "budget_bytes": budget, "rows": rows, "ckpt_tune_no_checkpointing_probe_bytes": probe_peak}


def _checkpointed(entries, blocks: tuple[str, ...]) -> str:
    """`4/6`, `6/6 in 2 segments` (runs of blocks checkpointed as one), `4/6 + 3 sub-modules` (parts of the
    other blocks), `2/4 + 2 under an op policy` (blocks whose chosen ops alone are recomputed)."""
    segs = sum(1 for e in entries if not isinstance(e, str))
    whole = sum(len(e) if not isinstance(e, str) else int(e in blocks) for e in entries)
    ops = sum(1 for e in entries if isinstance(e, str) and "@" in e)
    subs = sum(1 for e in entries if isinstance(e, str) and "@" not in e and e not in blocks)
    out = f"{whole}/{len(blocks)}" + (f" in {segs} segment{'s' if segs > 1 else ''}" if segs else "")
    out += f" + {subs} sub-module{'s' if subs > 1 else ''}" if subs else ""
    return out + (f" + {ops} under an op policy" if ops else "")


def report_model(ex, blocks: tuple[str, ...], runs: list[dict], summary: list[str]) -> list[str]:
    """The markdown sections of one model's budgets; appends its summary lines to `summary`."""
    parts = [f"## Model `{ex.spec}` ({len(blocks)} blocks)"]
    for run in runs:
        rows = run["rows"]
        tool = rows[0]
        parts += [
            f"### {ex.name}, budget {run['vram']} ({run['budget_bytes']:,} bytes)",
            md_table(
                ["finder", "batch found", "blocks checkpointed", "measured peak MiB", "fits", "steps run (+ failed first steps)",
                 "charged time", "time / ckpt-tune's", "old rule: time", "samples/s at the result"],
                [[r["finder"], r["batch"], _checkpointed(r["checkpointed"], blocks), mib(r["measured_bytes"]),
                  "yes" if r["fits"] else "NO",
                  (f"{r['real_steps']} real ({r['real_recorded']} recorded) + {r['fake_recorded']} fake" if r["trials"] is None
                   else f"{r['steps']} + {r['failed_steps']}"),
                  f"{r['wall_s']:.1f} s", f"{r['time_ratio_vs_ckpt_tune']:.2f}",
                  "-" if r["trials"] is None else f"{r['old_rule_s']:.1f} s", f"{r['samples_per_s']:.1f}"] for r in rows],
            ),
            "Trials (batch, fit?): " + "; ".join(f"{r['finder']}: {r['trials']}" for r in rows if r["trials"]),
            "Failing trials charged (batch: fraction of the first step before the failing allocation, seconds): " + "; ".join(
                f"{r['finder']}: " + ", ".join(f"{c['batch']}: {c['fraction_before_oom']:.2f}, {c['charged_s']:.2f} s"
                                               for c in r["charges"] if not c["fits"])
                for r in rows if r["trials"] and any(not c["fits"] for c in r["charges"])),
            f"ckpt-tune: {tool['recorded_steps'] - tool['real_recorded']} steps recorded under fake tensors in this process and "
            f"{tool['fake_recorded']} in all (forked processes included); {tool['real_steps']} real steps "
            f"({tool['real_recorded']} recorded, the rest timed or warm-up), of which {tool['real_over_budget']} peaked above the "
            f"budget; the largest real recorded peak {mib(tool['largest_real_peak'] or 0)} MiB of {mib(run['budget_bytes'])}. "
            f"The search cost {tool['search_in_plan_steps']:.1f} plain training steps of the plan it reports.",
        ]
        best = min(rows[1:], key=lambda r: r["wall_s"])
        faster = [r["finder"] for r in rows[1:] if r["wall_s"] < tool["wall_s"]]
        binsearch = next(r for r in rows if r["finder"] == "Lightning binsearch, every block")
        summary.append(
            f"{ex.name} {run['vram']}: ckpt-tune batch {tool['batch']} in {tool['wall_s']:.1f} s "
            f"({tool['search_in_plan_steps']:.1f} steps of its plan; {tool['real_over_budget']} real steps over the budget); "
            f"Lightning binsearch, every block: batch {binsearch['batch']} in {binsearch['wall_s']:.1f} s "
            f"({binsearch['wall_s'] / tool['wall_s']:.2f}x ckpt-tune's time); finders faster than ckpt-tune: "
            f"{', '.join(faster) if faster else 'none'} (fastest: {best['finder']}, batch {best['batch']}, {best['wall_s']:.1f} s)."
        )
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt,hf_gpt2,vit", help="examples, comma-separated")
    ap.add_argument("--vram", default="160MiB,320MiB", help="budgets, comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timed steps per configuration found")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable timings on a shared machine)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 160MiB only, 3 repeats")
    args = ap.parse_args()
    if args.quick:
        args.vram, args.repeats = "160MiB", 3
    torch.set_num_threads(args.threads)
    # torch's one-time initialisation, paid by any training process before its first step and charged to
    # no finder: the first optimizer built imports torch._dynamo (about 1.2 s here). Left in, it fell on
    # whichever finder ran first in the process (ckpt-tune, on the first model), not on the others.
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    summary: list[str] = []
    parts = [
        f"{args.threads} torch thread(s){' (--quick)' if args.quick else ''}. "
        "ckpt-tune: `api.search` end to end, as it runs on CPU: its probes are recorded under fake tensors with the CPU "
        "allocator's rules (shared out over forked processes), its step times and its verification are real steps "
        "(with one torch thread, run beside the fake steps on the core they leave free). "
        "Lightning finders: "
        f"init_val {INIT_VAL}, steps_per_trial {STEPS_PER_TRIAL}, max_trials {MAX_TRIALS}; a trial OOMs when the harness-measured "
        "peak exceeds the budget. **Charging rule**: a trial that fits is charged its three plain training steps; a trial "
        "that fails is charged what it costs on a GPU, where it dies inside its first step: one plain first step at that "
        "batch times the fraction of the (profiled) step that runs before live bytes first pass the budget, so at most "
        "one step; crash recovery is not charged. ckpt-tune is charged its whole wall time. Charged to no finder: torch's "
        "one-time initialisation (the first optimizer built imports torch._dynamo), done before the first finder runs. `old rule`: three full steps "
        "for every trial, failing ones included. Samples/s: median of interleaved steps of each configuration found "
        "(noisy on a shared machine; compare within one table only).",
    ]
    data = []
    for name in args.model.split(","):
        ex = example(name)
        blocks = tuple(find_blocks(ex.build()))
        runs = [run_budget(ex, v, blocks, args.repeats) for v in args.vram.split(",")]
        parts += report_model(ex, blocks, runs, summary)
        data.append({"model": ex.spec, "budgets": runs})
    load = " ".join(f"{x:.2f}" for x in __import__("os").getloadavg())
    parts[0] += f" Load average at the end: {load} on {__import__('os').cpu_count()} CPUs."
    parts.insert(1, "## Summary\n\n" + "\n".join(f"- {x}" for x in summary))
    body = "\n\n".join(parts)
    print(body)
    write_results("batch_finder", "Batch finding: ckpt-tune search vs trial and error",
                  {"threads": args.threads, "quick": args.quick, "models": data}, body)


if __name__ == "__main__":
    main()
