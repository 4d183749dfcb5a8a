"""Plan quality: checkpoint plans from several methods under the same budgets, measured side by side.

For each example at a fixed batch, four budgets between the harness-measured peaks of every-block
checkpointing and of no checkpointing (20/40/60/80% of the way up). Methods (peers first):

- no checkpointing; every block checkpointed (one unit per block);
- sqrt(n) as `torch.utils.checkpoint.checkpoint_sequential(blocks, round(sqrt(n)), x)` runs it: the
  first k-1 segments of floor(n/k) blocks each checkpointed as ONE unit, the remainder in the last
  segment, run without checkpointing (common.sqrt_segments);
- Chen et al. 2016's greedy ("Training Deep Nets with Sublinear Memory Cost", §4.3, Algorithm 3): walk
  the blocks accumulating their saved bytes; when the running sum passes B the block's output becomes a
  stored checkpoint and a new segment starts. Chen's memory estimate of a split is x + y: y the stored
  segment inputs, x the largest segment's activations, the last segment (kept from forward, never
  recomputed, and never live together with a recomputed one) counted as one of the segments, not added
  on top; on a base of the no-checkpointing peak less all block activations. Chen search B over a grid;
  to meet a budget here: over every contiguous run's sum as B, the split with the fewest recomputed blocks
  whose estimate fits the budget. Segments as checkpoint_sequential runs them (all but the last);
- PyTorch's `torch.distributed._tools.sac_ilp`, where it runs (it does not here: see the results);
- ckpt-tune's planner as `search --batch-size B --vram BUDGET` runs it: solve, verify, tighten;
- the optimality check (not a peer): the brute-force optimum over ckpt-tune's own candidates on its own
  memory model's terms (`planner.brute_force`), the terms and costs the search planned on (read after
  it: each search times which op policies to offer): it tells whether ckpt-tune's planner found the
  cheapest plan its model allows, nothing about the model.

Peers from benchmarks/peers.py (as their authors define them), where they apply:
- Hugging Face `gradient_checkpointing_enable()` (every layer; `peers.hf_gradient_checkpointing`) on
  Hugging Face models, and its `every_n_layers=2` (every second layer) where the installed transformers
  has it (`activation_checkpointing_enable(every_n_layers=...)`, transformers 5.x): budget-blind;
- `torch.compile` with `torch._functorch.config.activation_memory_budget` (inductor on CPU;
  `peers.Compiled`): each of `--compile-fractions` compiled on a fresh model and measured once; at each
  budget the largest fraction whose measured peak fits (the lowest peak where none does, marked over).

Every plan's peak is measured by the independent harness (common.measured_peak, own wrappers); recompute
overhead is the median step time with the plan over the median without, all plans of a model timed in
the same process with interleaved repeats.

    .venv/bin/python benchmarks/plan_quality.py [--models gpt,resnet] [--repeats 7] [--quick] [--allow-dirty]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import peers
from benchmarks.common import (
    EXAMPLES,
    SEGMENT_CHAIN_OK,
    TimedModel,
    block_sizes,
    example,
    interleaved_samples,
    make_optimizer,
    md_table,
    measured_peak,
    mib,
    plain,
    sqrt_segments,
    tool_searcher,
    wrap_blocks,
    wrap_segments,
)
from benchmarks.common import write_results as write
from ckpt_tune.errors import NoFitError
from ckpt_tune.tune.planner import brute_force

BATCH = {"gpt": 8, "resnet": 16, "unet": 8, "hf_gpt2": 2}
FRACTIONS = (0.2, 0.4, 0.6, 0.8)
BRUTE_MAX = 10  # blocks; K^10 predictions
OPTIMALITY = "optimality check: brute force on ckpt-tune's model (not a peer)"
TARGET_S = 6.0  # timed seconds of the no-checkpointing plan: more repeats for models with short steps


@dataclass(frozen=True)
class PlanSpec:
    """A plan as this benchmark applies it: single blocks, or segments each checkpointed as one unit."""

    names: tuple[str, ...] = ()  # blocks wrapped one by one
    segments: tuple[tuple[int, int], ...] = ()  # [start, end) over the units, run as one unit each
    ck: tuple[bool, ...] = ()  # which segments are checkpointed
    peer: str = ""  # "hf", "hf every 2", "compile": a peer's own switch (benchmarks/peers.py)
    fraction: float | None = None  # torch.compile's activation_memory_budget

    def wrap(self, units: tuple[str, ...]):
        if self.peer == "hf":
            return peers.hf_gradient_checkpointing
        if self.peer == "hf every 2":
            return hf_every_n_layers(2)
        if self.peer == "compile":
            return _COMPILED[0].wrap(self.fraction)
        if self.segments:
            return lambda m: wrap_segments(m, units, self.segments, self.ck)
        if self.names:
            return lambda m: wrap_blocks(m, self.names)
        return None

    def describe(self, units: tuple[str, ...]) -> str:
        if self.peer == "compile":
            return f"activation_memory_budget={self.fraction}"
        if self.peer:
            return {"hf": "every layer (HF)", "hf every 2": "every_n_layers=2 (HF)"}[self.peer]
        if self.segments:
            parts = [f"[{s}-{e - 1}]{'*' if c else ''}" for (s, e), c in zip(self.segments, self.ck, strict=True)]
            return " ".join(parts)
        if not self.names:
            return "-"
        return "{" + ",".join(_short(n, units) for n in self.names) + "}"


_COMPILED: list = [None]  # the model's peers.Compiled (its compiled instances are timed later)
COMPILE_FRACTIONS = (0.0, 0.5, 1.0)


def hf_every_n_layers(n: int):
    """A `wrap`: Hugging Face's own switch with `every_n_layers=n` (transformers 5.x), non-reentrant."""

    def wrap(model) -> None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=n)

    return wrap


def hf_every_n_unavailable(model) -> str | None:
    import inspect

    fn = getattr(model, "activation_checkpointing_enable", None)
    if fn is None or "every_n_layers" not in inspect.signature(fn).parameters:
        return "the installed transformers has no every_n_layers"
    return None


class PreparedModel(TimedModel):
    """A TimedModel around an instance already built and wrapped (a compiled one)."""

    def __init__(self, ex, model) -> None:
        self.ex, self.model = ex, model
        self.model.train()
        self.params = [q for q in model.parameters() if q.requires_grad]
        self.opt = make_optimizer(self.params, "adamw")


def _short(name, units: tuple[str, ...]) -> str:
    """Block index, index.sub-module for a finer option (e.g. `3.attn`), [first-last] for a segment."""
    if not isinstance(name, str):
        return f"[{units.index(name[0])}-{units.index(name[-1])}]"
    if "@" in name:  # an op-level policy entry, `module@policy`
        module, _, policy = name.rpartition("@")
        return f"{_short(module, units)}@{policy}"
    if name in units:
        return str(units.index(name))
    owners = [u for u in units if name.startswith(u + ".")]
    if not owners:  # a module that holds blocks (a stage), or anything else: its name
        return name
    owner = max(owners, key=len)
    return f"{units.index(owner)}.{name[len(owner) + 1:]}"


def segment_plan(segments: list[tuple[int, int]]) -> PlanSpec:
    """Checkpoint every segment but the last: checkpointing the last never lowers the peak."""
    return PlanSpec(segments=tuple(segments), ck=tuple(i < len(segments) - 1 for i in range(len(segments))))


def chen_segments(abar: list[int], b: float) -> list[tuple[int, int]]:
    """Chen et al. 2016, §4.3: accumulate block sizes; when the running sum passes B, that block's output
    becomes a stored checkpoint and a new segment starts."""
    segs, start, temp = [], 0, 0
    for i, a in enumerate(abar):
        temp += a
        if temp > b:
            segs.append((start, i + 1))
            start, temp = i + 1, 0
    if start < len(abar):
        segs.append((start, len(abar)))
    return segs


def chen_estimate(segs: list[tuple[int, int]], abar: list[int], ain: list[int], p_none: int) -> int:
    """Chen's x + y on a base of the no-checkpointing peak without the blocks' activations: y the stored
    inputs of the checkpointed segments (all but the last), x the largest segment's activations. The last
    segment's activations are live at the end of forward, a recomputed segment's during its backward,
    never both (the last segment's are freed by then): x is the larger of the two, not their sum."""
    base = p_none - sum(abar)
    y = sum(ain[s] for s, _ in segs[:-1])
    x = max(sum(abar[s:e]) for s, e in segs)
    return base + y + x


def chen_plan(abar: list[int], ain: list[int], p_none: int, budget: int) -> tuple[PlanSpec, int]:
    n = len(abar)
    grid = sorted({0, *(sum(abar[s:e]) for s in range(n) for e in range(s + 1, n + 1))})
    cands = []
    for b in grid:
        segs = chen_segments(abar, b)
        est = chen_estimate(segs, abar, ain, p_none)
        recomputed = sum(e - s for s, e in segs[:-1])
        cands.append((est > budget, recomputed if est <= budget else est, est, segs))
    _, _, est, segs = min(cands, key=lambda c: (c[0], c[1], c[2]))
    return segment_plan(segs), est


def try_sac_ilp() -> str | None:
    """None if torch's SAC ILP pipeline can run here, else why not (every blocker found)."""
    why = []
    try:
        importlib.import_module("torch.distributed._tools.sac_ilp")
    except ImportError as e:
        why.append(f"`import torch.distributed._tools.sac_ilp` fails: {e} (the MILP is written for PuLP/CBC)")
    try:
        importlib.import_module("pwlf")
    except ImportError:
        why.append("SACEstimator.pwlf_sac_tradeoff_curve needs `pwlf` (not installed)")
    if not torch.cuda.is_available():
        why.append(
            "RuntimeEstimator, which feeds the ILP's recompute times, needs CUDA in both modes "
            "('operator-level-benchmark' times with torch.cuda.Event, 'operator-level-cost-model' asserts "
            "torch.cuda.is_available())"
        )
    return "; ".join(why) or None


def run_model(name: str, repeats: int, compile_fractions: tuple[float, ...] = COMPILE_FRACTIONS) -> dict:
    ex = example(name)
    b = BATCH[name]
    s = tool_searcher(ex.spec)
    s.order_units(b)
    units = s.units
    n = len(units)
    t0 = time.perf_counter()
    peaks: dict[PlanSpec, int] = {}

    def peak(p: PlanSpec) -> int:
        if p not in peaks:
            peaks[p] = measured_peak(ex, b, wrap=p.wrap(units))
        return peaks[p]

    none, every = PlanSpec(), PlanSpec(names=units)
    p_none, p_all = peak(none), peak(every)
    budgets = [int(p_all + f * (p_none - p_all)) for f in FRACTIONS]
    print(f"{name}: batch {b}, {n} blocks, none {mib(p_none)} MiB, every block {mib(p_all)} MiB", flush=True)
    abar, ain = block_sizes(ex, units, b)
    fixed = {"no checkpointing": none, "every block": every}
    if SEGMENT_CHAIN_OK[name]:
        fixed["sqrt(n) segments"] = segment_plan(sqrt_segments(n))
    notes: dict[str, str] = {}
    why_hf = peers.hf_applies(ex.build())
    if why_hf is None:
        fixed["HF gradient_checkpointing_enable"] = PlanSpec(peer="hf")
        why_n = hf_every_n_unavailable(ex.build())
        if why_n is None:
            fixed["HF every_n_layers=2"] = PlanSpec(peer="hf every 2")
        else:
            notes["HF every_n_layers=2"] = why_n
    else:
        notes["HF gradient_checkpointing_enable"] = why_hf
    compiled_peaks: dict[float, int] = {}
    _COMPILED[0] = peers.Compiled(ex.make_batch, ex.loss_fn, b)
    why_compile = (peers.compile_unavailable() if compile_fractions else "not run (--compile-fractions empty)")
    if why_compile is None:
        for f in compile_fractions:
            compiled_peaks[f] = peak(PlanSpec(peer="compile", fraction=f))
            print(f"  torch.compile activation_memory_budget={f}: {mib(compiled_peaks[f])} MiB "
                  f"(compiled in {_COMPILED[0].compile_s.get(f)} s)", flush=True)
    else:
        notes["torch.compile memory budget"] = why_compile
    per_budget: list[dict] = []
    for frac, budget in zip(FRACTIONS, budgets, strict=True):
        entry: dict = {"fraction": frac, "budget_bytes": budget, "plans": {}}
        for label, p in fixed.items():
            entry["plans"][label] = {"plan": p}
        if SEGMENT_CHAIN_OK[name]:
            p, est = chen_plan(abar, ain, p_none, budget)
            entry["plans"]["Chen greedy"] = {"plan": p, "estimate_bytes": est}
        if compiled_peaks:
            fitting = [f for f, v in compiled_peaks.items() if v <= budget]
            f = max(fitting) if fitting else min(compiled_peaks, key=compiled_peaks.get)
            entry["plans"]["torch.compile memory budget"] = {"plan": PlanSpec(peer="compile", fraction=f),
                                                             **({} if fitting else {"note": "no swept fraction fits"})}
        try:
            res = s.search(budget, batch_size=b)
            entry["plans"]["ckpt-tune"] = {"plan": PlanSpec(names=plain(res.checkpoint)), "predicted_bytes": res.predicted_peak,
                                           "first_predicted_bytes": res.first_predicted_peak, "resolved": res.resolved,
                                           "verified_bytes": res.verified_peak, "predicted_overhead": res.recompute_fraction}
        except NoFitError as e:
            entry["plans"]["ckpt-tune"] = {"plan": None, "note": f"NoFitError: {e.message}"}
        # on the model the search planned on: each search offers the op policies its own timing finds
        # worth a probe, so the options (and every term and cost) before it can differ
        t, costs = s.terms(b), s.costs(b)
        if n <= BRUTE_MAX:
            bf = brute_force(t, costs, budget)
            entry["plans"][OPTIMALITY] = (
                {"plan": PlanSpec(names=plain(bf.names(t))), "predicted_bytes": bf.peak} if bf else {"plan": None, "note": "nothing fits the model"}
            )
        for v in entry["plans"].values():
            if v["plan"] is not None:
                v["measured_bytes"] = peak(v["plan"])
                v["fits"] = v["measured_bytes"] <= budget
        per_budget.append(entry)
        print(f"  budget {mib(budget)} MiB: " + ", ".join(
            f"{k} {v['plan'].describe(units) if v['plan'] else '-'} {mib(v.get('measured_bytes', 0))}{'' if v.get('fits') else ' OVER'}"
            for k, v in entry["plans"].items()), flush=True)
    s.runner.__exit__(None, None, None)
    # time every distinct plan against no checkpointing, interleaved
    plans = list(dict.fromkeys(v["plan"] for e in per_budget for v in e["plans"].values() if v["plan"] is not None))
    models: dict = {p: PreparedModel(ex, _COMPILED[0].models[p.fraction]) if p.peer == "compile" else TimedModel(ex, wrap=p.wrap(units))
                    for p in plans}
    models["control"] = TimedModel(ex)  # a second no-checkpointing instance: its ratio is the noise floor
    samples = interleaved_samples(models, b, repeats, target_s=TARGET_S)
    med = {k: statistics.median(v) for k, v in samples.items()}
    for e in per_budget:
        for v in e["plans"].values():
            if v["plan"] is not None:
                v["overhead"] = med[v["plan"]] / med[none]
    out = {
        "model": name, "batch": b, "units": list(units), "peers_not_run": notes,
        "compile_fractions_bytes": compiled_peaks, "compile_s": dict(_COMPILED[0].compile_s), "block_saved_bytes": abar, "block_input_bytes": ain,
        "none_bytes": p_none, "every_block_bytes": p_all, "step_s_none": med[none], "repeats": len(samples[none]),
        "control_ratio": med["control"] / med[none],
        "budgets": [
            {**{k: v for k, v in e.items() if k != "plans"},
             "plans": {k: {**{kk: vv for kk, vv in v.items() if kk != "plan"},
                           "plan": v["plan"].describe(units) if v["plan"] else None,
                           "checkpointed": list(v["plan"].names) if v["plan"] and v["plan"].names else None,
                           "segments": [list(x) for x in v["plan"].segments] if v["plan"] and v["plan"].segments else None}
                       for k, v in e["plans"].items()}}
            for e in per_budget
        ],
        "elapsed_s": time.perf_counter() - t0,
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(EXAMPLES))
    ap.add_argument("--repeats", type=int, default=7, help="timed steps per plan (interleaved), at least 5")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable timings on a shared machine)")
    ap.add_argument("--quick", action="store_true", help="smoke run: GPT and ResNet, budgets at 40%% and 80%%, 5 repeats")
    ap.add_argument("--compile-fractions", default=",".join(map(str, COMPILE_FRACTIONS)),
                    help="torch.compile activation_memory_budget fractions to sweep ('' to skip: minutes per compile)")
    ap.add_argument("--out", default="plan_quality", help="results/<OUT>.json and .md (a partial run under another name)")
    args = ap.parse_args()
    global FRACTIONS, TARGET_S
    if args.quick:
        args.models, args.repeats, FRACTIONS, TARGET_S = "gpt,resnet", 5, (0.4, 0.8), 0.0
    torch.set_num_threads(args.threads)
    sac = try_sac_ilp()
    cf = tuple(float(x) for x in args.compile_fractions.split(",") if x.strip())
    results = [run_model(m, max(5, args.repeats), cf) for m in args.models.split(",")]
    methods = list(dict.fromkeys(k for r in results for e in r["budgets"] for k in e["plans"]))
    if sac:
        methods.append("sac_ilp (torch)")
    if OPTIMALITY in methods:  # last, below the line: a check of ckpt-tune's planner, not a peer
        methods.remove(OPTIMALITY)
        methods.append(OPTIMALITY)
    summary = {}
    for meth in methods:
        cells = [e["plans"][meth] for r in results for e in r["budgets"] if meth in e["plans"]]
        ran = [c for c in cells if c.get("measured_bytes") is not None]
        fit = [c for c in ran if c["fits"]]
        over = [c["measured_bytes"] / e["budget_bytes"] - 1 for r in results for e in r["budgets"]
                for c in [e["plans"].get(meth)] if c and c.get("measured_bytes") is not None and not c["fits"]]
        rel = [e["plans"][meth]["overhead"] / e["plans"]["ckpt-tune"]["overhead"] for r in results for e in r["budgets"]
               if meth in e["plans"] and e["plans"][meth].get("fits") and e["plans"].get("ckpt-tune", {}).get("fits")]
        summary[meth] = {
            "cases": len(cells), "respected": len(fit),
            "median_time_vs_ckpt_tune_when_both_fit": statistics.median(rel) if rel else None,
            "median_overhead_when_fits": statistics.median([c["overhead"] for c in fit]) if fit else None,
            "worst_overshoot": max(over) if over else None,
        }
    under = [(v["overhead"] - 1) / v["predicted_overhead"] for r in results for e in r["budgets"]
             for v in [e["plans"].get("ckpt-tune", {})] if v.get("predicted_overhead")]
    recompute = {"median": statistics.median(under), "min": min(under), "max": max(under)} if under else None
    lines = [
        "Four budgets per model between the harness-measured peaks of every-block checkpointing and of no "
        "checkpointing; each plan's peak measured by the independent harness; overhead = median step time with "
        "the plan / without (same process, interleaved repeats). Plans: `{i,j}` = blocks i and j checkpointed one "
        "by one; `[a-b]*` = blocks a..b as one checkpointed segment, `[a-b]` = a segment left as is. sqrt(n): "
        "checkpoint_sequential's split (floor-sized segments, the remainder in the last, unchecked one). Chen greedy: "
        "Chen's x + y estimate with the last segment counted once. The optimality check is not a peer: it reads "
        "ckpt-tune's own terms and shows whether the planner found the cheapest plan of its model. "
        f"Load average at the end: {' '.join(f'{x:.2f}' for x in __import__('os').getloadavg())} on "
        f"{__import__('os').cpu_count()} CPUs: step times are from a machine shared with other work"
        f"{'; --quick: GPT and ResNet, two budgets' if args.quick else ''}.",
        "",
        "Peers from benchmarks/peers.py: HF gradient_checkpointing_enable (every layer) and every_n_layers=2 on Hugging Face "
        "models only (budget-blind); torch.compile with activation_memory_budget swept over "
        f"{', '.join(map(str, cf)) or 'nothing'} (each compiled on a fresh model, measured by the harness), at each budget the "
        "largest fraction that fits. Peers that did not run: " + ("; ".join(f"{r['model']}: {k}: {v}" for r in results
                                                                      for k, v in r["peers_not_run"].items()) or "none") + ".",
        "",
        f"PyTorch's `sac_ilp`: {'ran' if not sac else 'not run here. ' + sac + '.'}",
        "",
        "## Summary (all models and budgets)",
        "",
        md_table(["method", "budgets respected", "median overhead when it fits", "step time / ckpt-tune's, where both fit (median)",
                  "worst overshoot"],
                 [[m, f"{v['respected']}/{v['cases']}" if v["cases"] else "n/a",
                   f"{v['median_overhead_when_fits']:.3f}x" if v["median_overhead_when_fits"] else "-",
                   f"{v['median_time_vs_ckpt_tune_when_both_fit']:.3f}" if v["median_time_vs_ckpt_tune_when_both_fit"] else "-",
                   f"+{100 * v['worst_overshoot']:.1f}%" if v["worst_overshoot"] is not None else "-"] for m, v in summary.items()]),
    ]
    if recompute:
        lines += ["", f"ckpt-tune's predicted recompute fraction (the plan's `predicted_recompute_fraction`: its blocks' "
                  f"forward times over the step) against the measured extra step time: measured / predicted = "
                  f"{recompute['median']:.2f} (median; {recompute['min']:.2f}-{recompute['max']:.2f})."]
    for r in results:
        lines += ["", f"## {r['model']} (batch {r['batch']}, {len(r['units'])} blocks: {', '.join(r['units'])})", "",
                  f"No checkpointing {mib(r['none_bytes'])} MiB, every block {mib(r['every_block_bytes'])} MiB "
                  f"(harness); step without checkpointing {1e3 * r['step_s_none']:.0f} ms (median of {r['repeats']}); "
                  f"a second no-checkpointing instance timed alongside: {r['control_ratio']:.3f}x (the noise floor).", ""]
        rows = []
        for e in r["budgets"]:
            for k, v in e["plans"].items():
                rows.append([f"{mib(e['budget_bytes'])} ({int(100 * e['fraction'])}%)", k, v["plan"] or v.get("note", "-"),
                             mib(v["measured_bytes"]) if v.get("measured_bytes") else "-",
                             ("yes" if v["fits"] else f"no (+{100 * (v['measured_bytes'] / e['budget_bytes'] - 1):.1f}%)") if "fits" in v else "-",
                             f"{v['overhead']:.3f}x" if "overhead" in v else "-",
                             f"{1 + v['predicted_overhead']:.3f}x" if "predicted_overhead" in v else "-",
                             _prediction(v)])
        lines.append(md_table(["budget MiB", "method", "plan", "measured MiB", "fits", "overhead", "predicted overhead",
                               "model's prediction MiB (before the plan's run; re-solved on it)"], rows))
    body = "\n".join(lines)
    print(body)
    write(args.out, "Plan quality under a budget", {"sac_ilp": sac or "ran", "quick": args.quick, "summary": summary,
          "recompute_measured_over_predicted": recompute, "models": results}, body)


def _prediction(v: dict) -> str:
    """The model's prediction of a plan: made before the plan was first run, then (where the search solved
    again on terms that run measured) the re-solved figure, which is no longer out of sample."""
    if not v.get("predicted_bytes"):
        return "-"
    first = v.get("first_predicted_bytes")
    if first is not None and v.get("resolved"):
        return f"{mib(first)}; re-solved {mib(v['predicted_bytes'])}"
    return mib(first if first is not None else v["predicted_bytes"])


if __name__ == "__main__":
    main()
