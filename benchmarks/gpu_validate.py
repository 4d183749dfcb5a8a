"""GPU validation (one CUDA device, under 8 minutes): ckpt-tune's CUDA predictions against the allocator.

For each example:
1. accuracy: ckpt-tune on cuda (`Searcher.terms(b)` + `predict`, and `api.profile(...).peak_bytes`) against
   an independent step's `torch.cuda.max_memory_allocated()` (and `max_memory_reserved()`), for no
   checkpointing, every block and the planner's plan halfway between, at two batch sizes;
2. a 24 GiB card: `torch.cuda.set_per_process_memory_fraction(24 GiB / total)` caps the caching allocator
   as a 24 GiB card would; `api.search(vram="24GiB")` runs under the cap (as on such a card) and, if its
   own probes run out of memory there, again without the cap. The plan found is run under the cap, then
   batch + 1 with the plan: it must either run out of memory or be predicted not to fit;
3. recompute overhead: median step time (CUDA events, interleaved) with the plan over without, at the
   batch found, without the cap, against the plan's predicted_recompute_fraction.

Writes benchmarks/results/gpu_validate.json and .md. Without CUDA it says so and exits 0.

    .venv/bin/python benchmarks/gpu_validate.py [--models gpt,resnet] [--vram-gib 24] [--budget-s 450]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import EXAMPLES, example, md_table, mib, plain, wrap_blocks, write_results

BATCHES = {"gpt": (16, 64), "resnet": (64, 256), "unet": (32, 128), "hf_gpt2": (8, 32)}
GiB = 1 << 30
LIMIT_S = {"accuracy": 60, "card": 150}  # per model; --budget-s bounds the whole run


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


class CudaStep:
    """An independent training step on CUDA: fresh model, own checkpoint wrapper, AdamW."""

    def __init__(self, ex, checkpoint=()) -> None:
        self.ex = ex
        self.model = ex.build().cuda().train()
        if checkpoint:
            wrap_blocks(self.model, checkpoint)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-3)

    def step(self, b: int) -> None:
        for p in self.params:
            p.grad = None
        loss = self.ex.loss_fn(self.model, _to(self.ex.make_batch(b), "cuda"))
        loss.backward()
        self.opt.step()

    def peak(self, b: int) -> tuple[int, int]:
        self.step(b)  # warm-up: optimizer state exists from here on (steady state)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.step(b)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()

    def timed(self, b: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.step(b)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    def close(self) -> None:
        del self.model, self.opt, self.params
        _free()


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def cuda_peak(ex, b, checkpoint=()) -> tuple[int, int] | str:
    s = None
    try:
        s = CudaStep(ex, checkpoint)
        return s.peak(b)
    except torch.OutOfMemoryError:
        return "OOM"
    finally:
        if s is not None:
            s.close()
        _free()


@contextlib.contextmanager
def deadline(seconds: int):
    """Raise TimeoutError in the main thread after `seconds` (the section is recorded as timed out)."""

    def fire(signum, frame):
        raise TimeoutError(f"section exceeded {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(max(1, int(seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def accuracy(name: str) -> list[dict]:
    from benchmarks.common import tool_searcher
    from ckpt_tune import Settings, profile
    from ckpt_tune.tune.memory_model import predict
    from ckpt_tune.tune.planner import solve

    ex = example(name)
    rows = []
    # predictions first, then the tool's model leaves the device: max_memory_allocated() counts the whole
    # device, so nothing but the measured step may be resident while it runs
    s = tool_searcher(ex.spec, device="cuda")
    try:
        s.order_units(BATCHES[name][0])
        n = len(s.units)
        for b in BATCHES[name]:
            t = s.terms(b)
            none, every = (0,) * n, (1,) * n
            budget = (predict(t, none) + predict(t, every)) // 2
            sol = solve(t, s.costs(b), budget)
            plans = [("none", none), ("every block", every)] + ([("planner @ midpoint", sol.choice)] if sol else [])
            for label, choice in plans:
                rows.append({"model": name, "batch": b, "plan": label, "checkpointed": list(plain(t.names(choice))),
                             "predicted_bytes": predict(t, choice)})
    finally:
        s.runner.__exit__(None, None, None)
        s.runner.model.to("cpu")
        del s
        _free()
    for row in rows:
        got = cuda_peak(ex, row["batch"], row["checkpointed"])
        if isinstance(got, str):
            row["measured"] = got
        else:
            row.update(allocated_bytes=got[0], reserved_bytes=got[1], error=(row["predicted_bytes"] - got[0]) / got[0])
        print(row, flush=True)
    for b in BATCHES[name]:
        prof = profile(ex.spec, batch_size=b, settings=Settings(device="cuda"), scaling=False)
        _free()
        truth = next((r for r in rows if r["batch"] == b and r["plan"] == "none" and "allocated_bytes" in r), None)
        if truth:
            rows.append({"model": name, "batch": b, "plan": "ckpt-tune profile", "predicted_bytes": prof.peak_bytes,
                         "allocated_bytes": truth["allocated_bytes"], "reserved_bytes": truth["reserved_bytes"],
                         "error": (prof.peak_bytes - truth["allocated_bytes"]) / truth["allocated_bytes"]})
            print(rows[-1], flush=True)
    return rows


def card(name: str, vram_gib: float, repeats: int) -> dict:
    from ckpt_tune import Settings, search

    ex = example(name)
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, vram_gib * GiB / total)
    out: dict = {"model": name, "vram_gib": vram_gib, "fraction": fraction, "total_bytes": total}
    torch.cuda.set_per_process_memory_fraction(fraction)
    t0 = time.perf_counter()
    outcome = None
    torch.cuda.reset_peak_memory_stats()
    try:
        outcome = search(ex.spec, vram=f"{vram_gib:g}GiB", settings=Settings(device="cuda"))
        out["search_under_cap"] = "ok"
        # the safety contract (docs/design.md §3): no real step of the search past the budget plus its margin
        out["search_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        limit = outcome.budget.usable_bytes + outcome.budget.margin_bytes
        out["search_within_budget_plus_margin"] = out["search_max_allocated_bytes"] <= limit
        out["search_real_steps"] = outcome.result.real_steps
        out["search_largest_real_peak"] = outcome.result.largest_real_peak
    except Exception as e:  # the tool's own probes may not fit the card
        out["search_under_cap"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    _free()  # outside the except clause: the exception's frames held the failed probe's tensors
    if outcome is None:
        torch.cuda.set_per_process_memory_fraction(1.0)
        outcome = search(ex.spec, vram=f"{vram_gib:g}GiB", settings=Settings(device="cuda"))
    out["search_s"] = time.perf_counter() - t0
    _free()
    plan = outcome.plan
    b, names = plan.batch_size, list(plain(plan.checkpoint))
    out.update(batch=b, checkpointed=names, predicted_bytes=plan.predicted_peak_bytes, usable_bytes=outcome.budget.usable_bytes,
               predicted_recompute=plan.predicted_recompute_fraction, verified_bytes=outcome.result.verified_peak)
    nxt = next((r for r in outcome.result.frontier if r.batch_size == b + 1), None)
    out["next_predicted_fits"] = nxt.fits if nxt else None
    torch.cuda.set_per_process_memory_fraction(fraction)
    got = cuda_peak(ex, b, names)
    out["found"] = got if isinstance(got, str) else {"allocated_bytes": got[0], "reserved_bytes": got[1]}
    got1 = cuda_peak(ex, b + 1, names)
    out["next"] = got1 if isinstance(got1, str) else {"allocated_bytes": got1[0], "reserved_bytes": got1[1]}
    out["next_ok"] = got1 == "OOM" or out["next_predicted_fits"] is False
    torch.cuda.set_per_process_memory_fraction(1.0)
    _free()
    # recompute overhead at the batch found, without the cap
    steps = {}
    try:
        steps = {"none": CudaStep(ex), "plan": CudaStep(ex, names)}
        for s in steps.values():
            s.step(b)
        times: dict[str, list[float]] = {k: [] for k in steps}
        for r in range(repeats):
            for k in (list(steps) if r % 2 == 0 else list(reversed(steps))):
                times[k].append(steps[k].timed(b))
        out["overhead"] = statistics.median(times["plan"]) / statistics.median(times["none"])
    except torch.OutOfMemoryError:
        out["overhead"] = "no checkpointing does not fit the whole device at this batch"
    finally:
        for s in steps.values():
            s.close()
        _free()
    print(out, flush=True)
    return out


def render(acc: list[dict], cards: list[dict], skipped: list[str], vram_gib: float, elapsed: float, device: str) -> tuple[str, dict]:
    """The Markdown body and the summary of a run (pure: testable without a GPU)."""
    errs = [abs(r["error"]) for r in acc if "error" in r]
    summary = {"accuracy_cases": len(errs), "median_abs_error": statistics.median(errs) if errs else None,
               "max_abs_error": max(errs) if errs else None,
               "cards_fitting": sum(1 for c in cards if isinstance(c.get("found"), dict) and c["found"]["allocated_bytes"] <= c["vram_gib"] * GiB),
               "cards_next_ok": sum(1 for c in cards if c.get("next_ok")), "cards": len(cards), "skipped": skipped,
               "elapsed_s": elapsed, "device": device}
    body = "\n\n".join([
        f"Device: {summary['device']}. Accuracy: predicted vs `max_memory_allocated()` of an independent step; "
        f"median abs. error {100 * (summary['median_abs_error'] or 0):.2f}%, max {100 * (summary['max_abs_error'] or 0):.2f}% "
        f"over {len(errs)} cases.",
        md_table(["model", "batch", "plan", "predicted MiB", "max_memory_allocated MiB", "max_memory_reserved MiB", "error"],
                 [[r["model"], r["batch"], r["plan"], mib(r["predicted_bytes"]),
                   mib(r["allocated_bytes"]) if "allocated_bytes" in r else r.get("measured"),
                   mib(r["reserved_bytes"]) if "reserved_bytes" in r else "-",
                   f"{100 * r['error']:+.2f}%" if "error" in r else "-"] for r in acc]),
        f"A {vram_gib:g} GiB card (set_per_process_memory_fraction):",
        md_table(["model", "search under the cap", "search's max allocated MiB (within budget + margin)", "batch", "checkpointed",
                  "predicted MiB", "run under the cap: allocated / reserved MiB",
                  "batch + 1", "overhead (measured)", "overhead (predicted)"],
                 [[c["model"], c["search_under_cap"],
                   f"{mib(c['search_max_allocated_bytes'])} ({'yes' if c['search_within_budget_plus_margin'] else 'NO'})"
                   if "search_max_allocated_bytes" in c else "-",
                   c["batch"], len(c["checkpointed"]), mib(c["predicted_bytes"]),
                   f"{mib(c['found']['allocated_bytes'])} / {mib(c['found']['reserved_bytes'])}" if isinstance(c["found"], dict) else c["found"],
                   (c["next"] if isinstance(c["next"], str) else f"runs ({mib(c['next']['allocated_bytes'])} MiB)")
                   + (", predicted not to fit" if c["next_predicted_fits"] is False else ""),
                   f"{c['overhead']:.3f}x" if isinstance(c["overhead"], float) else c["overhead"],
                   f"{1 + c['predicted_recompute']:.3f}x"] for c in cards]),
        "Skipped: " + ("; ".join(skipped) if skipped else "nothing"),
    ])
    return body, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(EXAMPLES))
    ap.add_argument("--vram-gib", type=float, default=24.0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--budget-s", type=float, default=450, help="stop starting new sections after this many seconds")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_validate: no CUDA device (torch.cuda.is_available() is False); nothing to validate here.")
        return
    t_start = time.perf_counter()
    models = args.models.split(",")
    acc, cards, skipped = [], [], []
    for name in models:
        for section, fn in (("accuracy", lambda n=name: acc.extend(accuracy(n))),
                            ("card", lambda n=name: cards.append(card(n, args.vram_gib, args.repeats)))):
            left = args.budget_s - (time.perf_counter() - t_start)
            if left < 20:
                skipped.append(f"{name} {section}: out of time")
                continue
            try:
                with deadline(int(min(left, LIMIT_S[section]))):
                    fn()
            except Exception as e:
                skipped.append(f"{name} {section}: {type(e).__name__}: {e}")
                traceback.print_exc()
            torch.cuda.set_per_process_memory_fraction(1.0)
            _free()
    body, summary = render(acc, cards, skipped, args.vram_gib, time.perf_counter() - t_start, torch.cuda.get_device_name(0))
    print(body)
    write_results("gpu_validate", "GPU validation", {"summary": summary, "accuracy": acc, "cards": cards}, body)


if __name__ == "__main__":
    main()
