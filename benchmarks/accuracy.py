"""Prediction accuracy, in sample and out of sample: ckpt-tune's predicted peak against an independent
allocator measurement.

`search` cuts its memory model's terms out of recorded runs: at each batch it probes, the runs of
`probe_configs` (no checkpointing, every block, even blocks, odd blocks, and each finer option, such as
every block's `attn` or `mlp`, throughout). Predicting one of those plans at that batch reads a recorded
run back: that is **in sample**, a check of the bookkeeping, not of the model. The figure that matters
is **out of sample**, plans and batches the search never ran:

- `random plans`: seeded random plans over the candidates (each block stored, checkpointed, or one of
  its finer options; runs of blocks as one segment, whose terms are estimated), excluding the probed
  configurations, predicted from the terms probed at that batch; plus the planner's plan for a budget
  halfway between no checkpointing and every block;
- `other batches`: batches never probed, predicted from terms fitted as a line through batches 1 and 4
  (`Terms.interpolate`, search's first guess), for no checkpointing, every block and random plans;
- `zoo`: members of the conformance zoo (tests/zoo: torchvision, timm, transformers, peft, RNNs), random
  plans at the member's profile batch.

Truth is tests/harness.measured_peak (common.measured_peak): a fresh model, the harness's own checkpoint
wrappers, the CPU allocator's events. `profile` compares `ckpt-tune profile`'s peak with the harness's
no-checkpointing peak (in sample too: profile reports a recorded run).

    .venv/bin/python benchmarks/accuracy.py [--models gpt,resnet] [--zoo hf_bert,tv_vit] [--quick] [--allow-dirty]
"""

from __future__ import annotations

import argparse
import random
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
from ckpt_tune.tune.memory_model import predict, probe_configs, segment_code
from ckpt_tune.tune.planner import solve

BATCHES = {"gpt": (2, 4, 8), "resnet": (4, 8, 16), "unet": (2, 4, 8), "hf_gpt2": (1, 2, 4)}  # probed
OTHER = {"gpt": (3, 6, 12), "resnet": (3, 6, 12), "unet": (3, 6, 12), "hf_gpt2": (3, 6)}  # never probed
QUICK = {"gpt": (2, 4), "resnet": (4, 8), "unet": (2, 4), "hf_gpt2": (1, 2)}
QUICK_OTHER = {"gpt": (6,), "resnet": (6,), "unet": (6,), "hf_gpt2": (3,)}
FIT = (1, 4)  # the batch sizes search fits its line through
ZOO = ("tv_mobilenet_v3_small", "tv_vit", "timm_vit", "hf_bert", "hf_llama", "hf_t5", "peft_lora_llama", "gru_lm")
QUICK_ZOO = ("tv_vit", "hf_bert")
RANDOM_PLANS = 4  # per probed batch (examples) and per zoo member
RANDOM_OTHER = 2  # per unprobed batch
SEED = 17

IN_SAMPLE = "in sample: probed plans at a probed batch"
OOS_RANDOM = "out of sample: random plans at a probed batch"
OOS_OTHER = "out of sample: unprobed batches (fitted terms)"
OOS_ZOO = "out of sample: zoo models, random plans"


def random_plan(rng: random.Random, s, t, avoid: set[tuple[int, ...]]) -> tuple[int, ...] | None:
    """A random plan over the searcher's candidates, not one of `avoid` (None after 200 tries)."""
    n = len(t.units)
    starts: dict[int, list[int]] = {}
    for i, j in t.segments:
        starts.setdefault(i, []).append(j)
    for _ in range(200):
        choice: list[int] = []
        i = 0
        while i < n:
            if starts.get(i) and rng.random() < 0.2:
                j = rng.choice(starts[i])
                choice += segment_code(i, j)
                i = j + 1
                continue
            opts = [k for k in range(t.k) if k < 2 or s._has(i, k)]
            choice.append(rng.choice(opts))
            i += 1
        c = tuple(choice)
        if c not in avoid:
            return c
    return None


def case(model: str, b: int, label: str, kind: str, choice, t, fitted, measure) -> dict | None:
    """Predict `choice` on `t` (and on `fitted` when given), measure it with the harness."""
    names = list(plain(t.names(choice)))
    try:
        measured = measure(names)
    except Exception as e:  # the harness's own wrappers cannot run this plan: reported, not counted
        print(f"{model:22} b={b:<3} {label:20} harness failed: {type(e).__name__}: {e}"[:200], flush=True)
        return {"model": model, "batch": b, "plan": label, "set": kind, "checkpointed": [str(x) for x in names],
                "harness_error": f"{type(e).__name__}: {str(e)[:200]}"}
    pred = predict(t if fitted is None else fitted, choice)
    row = {
        "model": model, "batch": b, "plan": label, "set": kind, "choice": list(choice),
        "checkpointed": [x if isinstance(x, str) else list(x) for x in names],
        "segments": sum(1 for x in names if not isinstance(x, str)),
        "predicted_bytes": pred, "measured_bytes": measured, "error": (pred - measured) / measured,
    }
    print(f"{model:22} b={b:<3} {label:20} ckpt={len(names)} predicted {mib(pred)} MiB measured {mib(measured)}  "
          f"err {pct(row['error'])}  [{kind.split(':')[0]}]", flush=True)
    return row


FAKE_PROBES = False  # --fake-probes


def run_model(name: str, batches: tuple[int, ...], others: tuple[int, ...], rng: random.Random) -> tuple[list[dict], list[dict]]:
    ex = example(name)
    s = tool_searcher(ex.spec, fake_probes=FAKE_PROBES)
    s.order_units(min(batches))
    n = len(s.units)

    def measure_at(b):
        return lambda names: measured_peak(ex, b, checkpoint=names)

    rows, prof_rows = [], []
    for b in batches:
        t = s.terms(b)
        probed = probe_configs(n, t.k, s._has)
        for label, choice in probed.items():
            rows.append(case(name, b, f"probed: {label}", IN_SAMPLE, choice, t, None, measure_at(b)))
        avoid = set(probed.values())
        sol = solve(t, s.costs(b), (predict(t, (0,) * n) + predict(t, (1,) * n)) // 2)
        if sol is not None and tuple(sol.choice) not in avoid:
            rows.append(case(name, b, "planner @ midpoint", OOS_RANDOM, tuple(sol.choice), t, None, measure_at(b)))
            avoid.add(tuple(sol.choice))
        for r in range(RANDOM_PLANS):
            c = random_plan(rng, s, t, avoid)
            if c is not None:
                avoid.add(c)
                rows.append(case(name, b, f"random {r + 1}", OOS_RANDOM, c, t, None, measure_at(b)))
        prof = tool_profile(ex.spec, batch_size=b, settings=Settings(device="cpu"), scaling=False)
        truth = next(r["measured_bytes"] for r in rows if r and r["batch"] == b and r["plan"] == "probed: none")
        prof_rows.append({"model": name, "batch": b, "profile_bytes": prof.peak_bytes, "measured_bytes": truth,
                          "error": (prof.peak_bytes - truth) / truth})
    t1, t4 = s.terms(FIT[0]), s.terms(FIT[1])
    for b in others:
        fitted = t1.interpolate(t4, b)
        plans = {"none": (0,) * n, "every block": (1,) * n}
        for r in range(RANDOM_OTHER):
            c = random_plan(rng, s, fitted, set(plans.values()))
            if c is not None:
                plans[f"random {r + 1}"] = c
        for label, choice in plans.items():
            rows.append(case(name, b, label, OOS_OTHER, choice, fitted, None, measure_at(b)))
    s.runner.__exit__(None, None, None)
    return [r for r in rows if r], prof_rows


def run_zoo_member(name: str, rng: random.Random) -> list[dict]:
    from tests.zoo import checks
    from tests.zoo.members import MEMBERS

    m = MEMBERS[name]
    b = m.profile_batch
    s = tool_searcher(m.path_spec, fake_probes=FAKE_PROBES)
    s.order_units(b)
    t = s.terms(b)
    n = len(s.units)
    avoid = set(probe_configs(n, t.k, s._has).values())
    rows = []
    for r in range(RANDOM_PLANS):
        c = random_plan(rng, s, t, avoid)
        if c is None:
            continue
        avoid.add(c)
        rows.append(case(name, b, f"random {r + 1}", OOS_ZOO, c, t, None,
                         lambda names: checks.truth(name, b, checks.hashable(names))))
    s.runner.__exit__(None, None, None)
    return [r for r in rows if r]


def summary(rows: list[dict]) -> dict:
    errors = [r["error"] for r in rows]
    if not errors:
        return {"n": 0}
    a = [abs(e) for e in errors]
    return {"n": len(a), "exact": sum(1 for r in rows if r["predicted_bytes"] == r["measured_bytes"]),
            "median_abs": statistics.median(a), "max_abs": max(a), "worst_signed": max(errors, key=abs),
            "under": sum(1 for e in errors if e < 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(EXAMPLES))
    ap.add_argument("--zoo", default=None, help="zoo members (comma-separated; default: a fast eight; 'none': skip)")
    ap.add_argument("--quick", action="store_true", help="two probed batches, one unprobed, two zoo members")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a CPU kernel's scratch can depend on them: docs/design.md §3)")
    ap.add_argument("--fake-probes", action="store_true",
                    help="the probes under fake tensors with the CPU allocator's rules, as `search` records them on "
                         "--device cpu; results in accuracy_fake_probes.md")
    args = ap.parse_args()
    global FAKE_PROBES
    FAKE_PROBES = args.fake_probes
    torch.set_num_threads(args.threads)
    rng = random.Random(SEED)
    t0 = time.perf_counter()
    rows, prof_rows = [], []
    for name in args.models.split(","):
        r, p = run_model(name, (QUICK if args.quick else BATCHES)[name], (QUICK_OTHER if args.quick else OTHER)[name], rng)
        rows += r
        prof_rows += p
    zoo = QUICK_ZOO if args.quick else ZOO
    if args.zoo is not None:
        zoo = () if args.zoo == "none" else tuple(args.zoo.split(","))
    for name in zoo:
        rows += run_zoo_member(name, rng)
    failed = [r for r in rows if "harness_error" in r]
    rows = [r for r in rows if "harness_error" not in r]
    sets = (IN_SAMPLE, OOS_RANDOM, OOS_OTHER, OOS_ZOO)
    summ = {k: summary([r for r in rows if r["set"] == k]) for k in sets}
    summ["out of sample, all"] = summary([r for r in rows if r["set"] != IN_SAMPLE])
    summ["profile (in sample)"] = summary([{**r, "predicted_bytes": r["profile_bytes"]} for r in prof_rows])
    elapsed = time.perf_counter() - t0
    head = summ["out of sample, all"]
    stable = md_table(
        ["set", "cases", "exact to the byte", "under-estimates", "median abs. error", "max abs. error", "worst (signed)"],
        [[f"**{k}**" if k == "out of sample, all" else k, v["n"], v.get("exact", "-"), v.get("under", "-"),
          f"{100 * v['median_abs']:.2f}%" if v["n"] else "-", f"{100 * v['max_abs']:.2f}%" if v["n"] else "-",
          pct(v["worst_signed"]) if v["n"] else "-"] for k, v in summ.items()],
    )
    per_model = {}
    for m in dict.fromkeys(r["model"] for r in rows):
        per_model[m] = {k: summary([r for r in rows if r["model"] == m and r["set"] == k]) for k in sets}
    mtable = md_table(
        ["model", "in sample: cases / max abs. error", "out of sample: cases / median / max abs. error"],
        [[m, f"{v[IN_SAMPLE]['n']} / {100 * v[IN_SAMPLE]['max_abs']:.2f}%" if v[IN_SAMPLE]["n"] else "-",
          (lambda o: f"{o['n']} / {100 * o['median_abs']:.2f}% / {100 * o['max_abs']:.2f}%" if o["n"] else "-")(
              summary([r for r in rows if r["model"] == m and r["set"] != IN_SAMPLE]))]
         for m, v in per_model.items()],
    )
    table = md_table(
        ["set", "model", "batch", "plan", "entries (segments)", "predicted MiB", "measured MiB", "predicted - measured", "error"],
        [[r["set"].split(":")[0] + (": " + r["set"].split(": ")[1].split(",")[0] if r["set"] != IN_SAMPLE else ""),
          r["model"], r["batch"], r["plan"], f"{len(r['checkpointed'])} ({r['segments']})", mib(r["predicted_bytes"]),
          mib(r["measured_bytes"]), f"{r['predicted_bytes'] - r['measured_bytes']:+,} B", pct(r["error"])] for r in rows],
    )
    ptable = md_table(
        ["model", "batch", "`ckpt-tune profile` MiB", "measured MiB", "profile - measured", "error"],
        [[r["model"], r["batch"], mib(r["profile_bytes"]), mib(r["measured_bytes"]),
          f"{r['profile_bytes'] - r['measured_bytes']:+,} B", pct(r["error"])] for r in prof_rows],
    )
    worst = max((r for r in rows if r["set"] != IN_SAMPLE), key=lambda r: abs(r["error"]), default=None)
    parts = [
        "Predicted peak (ckpt-tune's memory model) against the peak measured by an independent harness "
        "(tests/harness.py: fresh model, its own checkpoint wrappers, CPU allocator events from torch.profiler). "
        "Error = (predicted - measured) / measured; positive means the tool over-estimates (safe side). "
        "**In sample**: the plans search records at a batch it probes (probe_configs: none, every block, even, odd, "
        "each finer option throughout), predicted at that batch: the prediction reads a recorded run back. "
        "**Out of sample** (the headline): seeded random plans over the candidates (segments included, their terms "
        "estimated) and the planner's midpoint plan at a probed batch; no checkpointing, every block and random plans "
        "at batches never probed, from terms fitted through batches 1 and 4; random plans on zoo models "
        f"(tests/zoo). Seed {SEED}. Ran in {elapsed:.0f} s.",
        "## Summary", stable,
    ]
    if head["n"]:
        parts.append(
            f"Out of sample: {head['n']} cases, {head['exact']} exact to the byte, median abs. error "
            f"{100 * head['median_abs']:.2f}%, max {100 * head['max_abs']:.2f}% ({worst['model']} batch {worst['batch']}, "
            f"{worst['plan']}, {worst['set'].split(': ')[1]}), {head['under']} under-estimates."
        )
    if failed:
        parts.append("Plans the harness's own wrappers could not run (not counted): " + "; ".join(
            f"{r['model']} b={r['batch']} {r['plan']} {r['checkpointed']}: {r['harness_error']}" for r in failed))
    parts += ["## Per model", mtable, "## Every case", table, "## `ckpt-tune profile`", ptable]
    body = "\n\n".join(parts)
    print(stable)
    write_results("accuracy_fake_probes" if FAKE_PROBES else "accuracy",
                  "Prediction accuracy: in sample and out of sample" + (", probes under fake tensors" if FAKE_PROBES else ""),
                  {"seed": SEED, "summary": summ, "per_model": per_model, "rows": rows, "harness_failures": failed,
                   "profile_rows": prof_rows, "elapsed_s": elapsed}, body)


if __name__ == "__main__":
    main()
