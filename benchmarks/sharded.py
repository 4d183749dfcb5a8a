"""Sharded data parallelism: ckpt-tune's sharded plans against rank 0's peak under PyTorch's engines.

For each model, world size (2, 4, 8) and stage (zero1: `ZeroRedundancyOptimizer` over AdamW; zero2:
FSDP2 `fully_shard` per block and at the root with reshard_after_forward=False; zero3: the same with
True; `--shard fsdp` is the zero3 configuration, measure/sharded.py ENGINES):

1. ground truth for two fixed plans, no checkpointing and every block, by tests/sharded_worker.py's
   harness (torch.profiler's CPU allocator events, no ckpt_tune code; the engine set up with torch alone,
   rank 0 of a fake process group, checkpoint wrappers applied before sharding);
2. a budget halfway between the two, and `ckpt_tune.search(..., world_size=N, shard=S)` at the fixed
   batch: the plan, its predicted per-rank peak and the time the search took;
3. the plan measured by the same harness: the error of the prediction, and whether it is within budget.

The arithmetic that `search` used before the engine was recorded (one device's terms through
tune/sharding.py `per_gpu_terms`) is shown beside it for the "none" and "every block" plans.

    .venv/bin/python benchmarks/sharded.py [--quick] [--allow-dirty]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "zoo"))

import harness  # noqa: E402
import sharded_worker  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import md_table, mib, pct, write_results  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import ckpt_tune  # noqa: E402
from ckpt_tune.measure import loader, user_code  # noqa: E402
from ckpt_tune.measure.runner import StepRunner  # noqa: E402
from ckpt_tune.measure.session import Settings  # noqa: E402
from ckpt_tune.plan.entry import to_data  # noqa: E402
from ckpt_tune.tune.memory_model import predict  # noqa: E402
from ckpt_tune.tune.searcher import Searcher  # noqa: E402
from ckpt_tune.tune.sharding import per_gpu_terms  # noqa: E402

MODELS = {
    "gpt": ("examples/gpt.py:build", 2),
    "hf_gpt2": ("examples/hf_gpt2.py:build", 2),
    "vit": ("tests/zoo/tv_vit.py:build", 8),
    "lora_llama": ("tests/zoo/peft_lora.py:build", 4),
}
WORLD_SIZES = (2, 4, 8)
STAGES = ("zero1", "zero2", "zero3")
# op policies are left out to keep the run short: their recompute is timed per block on the CPU, which
# takes most of a search here, and their bytes are recorded like any option's (results/ops.md)
CANDIDATES = frozenset({"blocks", "submodules", "segments"})


def measured(target, units, batch: int, world_size: int, shard: str, checkpoint) -> int:
    """Rank 0's peak by the independent harness, the engine set up with torch alone."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        wrap_engine, make_opt = sharded_worker.engine(shard, init_device_mesh("cpu", (world_size,)), units)

        def wrap(model):
            if checkpoint:  # checkpoint wrappers go on before sharding
                harness.wrap_blocks(model, checkpoint)
            if wrap_engine is not None:
                wrap_engine(model)

        def make_optimizer(params):
            return make_opt(params) if shard == "zero1" else torch.optim.AdamW(params, lr=0.0)

        return sharded_worker.measured_peak(
            lambda: user_code.build_model(target), lambda b: user_code.make_batch(target, b),
            lambda m, b: user_code.compute_loss(target, m, b), batch, wrap, make_optimizer,
        )
    finally:
        dist.destroy_process_group()


def single_device(spec: str, batch: int):
    """One device's terms, state bytes and blocks (what the arithmetic divides)."""
    target = loader.load_target(spec)
    runner = StepRunner(user_code.build_model(target), lambda b: user_code.make_batch(target, b),
                        lambda m, b: user_code.compute_loss(target, m, b))
    with runner:
        s = Searcher(runner, candidates=frozenset({"blocks"}))
        s.order_units(batch)
        terms = s.terms(batch)
        params, opt, _grads = runner.state_bytes()
        return target, terms, params, opt, s.gathered_bytes(), s.units, {k: s.names(c) for k, c in {
            "none": (0,) * len(s.units), "every block": (1,) * len(s.units)}.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="gpt only, world size 4")
    args = ap.parse_args()
    models = {"gpt": MODELS["gpt"]} if args.quick else MODELS
    worlds = (4,) if args.quick else WORLD_SIZES
    rows, data = [], []
    for name, (spec, batch) in models.items():
        target, terms, params, opt, gathered, units, fixed = single_device(spec, batch)
        choices = {"none": (0,) * len(units), "every block": (1,) * len(units)}
        for w in worlds:
            for shard in STAGES:
                t0 = time.perf_counter()
                truth = {k: measured(target, units, batch, w, shard, to_data(fixed[k])) for k in fixed}
                arith = {k: predict(per_gpu_terms(terms, params, opt, w, shard, gathered), c) for k, c in choices.items()}
                budget = (truth["none"] + truth["every block"]) // 2
                t1 = time.perf_counter()
                out = ckpt_tune.search(spec, vram=f"{budget}B", batch_size=batch, world_size=w, shard=shard,
                                       settings=Settings(device="cpu"), candidates=CANDIDATES)
                search_s = time.perf_counter() - t1
                plan = out.plan
                got = measured(target, units, batch, w, shard, to_data(plan.checkpoint))
                err = (plan.predicted_peak_bytes - got) / got
                row = {
                    "model": name, "batch": batch, "world_size": w, "shard": shard,
                    "sharding": out.sharding,
                    "none_measured": truth["none"], "none_arithmetic": arith["none"],
                    "every_block_measured": truth["every block"], "every_block_arithmetic": arith["every block"],
                    "budget": budget, "plan": to_data(plan.checkpoint), "predicted_peak": plan.predicted_peak_bytes,
                    "verified_peak": plan.verified_peak_bytes, "measured_peak": got, "error": round(err, 6),
                    "within_budget": got <= budget, "recorded_steps": out.result.probes,
                    "search_seconds": round(search_s, 1), "seconds": round(time.perf_counter() - t0, 1),
                }
                data.append(row)
                rows.append([
                    name, batch, w, shard, mib(truth["none"]), pct((arith["none"] - truth["none"]) / truth["none"]),
                    mib(truth["every block"]),
                    pct((arith["every block"] - truth["every block"]) / truth["every block"]), mib(budget),
                    len(plan.checkpoint), mib(plan.predicted_peak_bytes), mib(got), pct(err),
                    "yes" if got <= budget else "**no**", f"{search_s:.0f}",
                ])
                print(row, file=sys.stderr, flush=True)
    errs = [abs(r["error"]) for r in data]
    old = [abs((r[f"{k}_arithmetic"] - r[f"{k}_measured"]) / r[f"{k}_measured"]) for r in data for k in ("none", "every_block")]
    fits = sum(r["within_budget"] for r in data)
    body = (
        "Rank 0 of a fake process group; every measured peak by the independent harness (tests/sharded_worker.py: "
        "torch.profiler's CPU allocator events, engine set up with torch alone). MiB. `none` / `every block`: "
        "the two fixed plans measured, and the error of the old arithmetic (one device's terms divided, "
        "tune/sharding.py) on them. The budget is halfway between them; `ckpt_tune.search(..., world_size, "
        "shard)` at the fixed batch (blocks, sub-modules and segments; op policies left out for time) records rank 0's step under the engine and plans on it; its plan is then "
        "measured. Error = (predicted - measured) / measured.\n\n"
        + md_table(["model", "batch", "world", "stage", "none", "arith. error", "every block", "arith. error",
                    "budget", "entries", "predicted", "measured", "error", "≤ budget", "search s"], rows)
        + f"\n\nPlans within budget: {fits} of {len(data)}. Largest |error| of ckpt-tune's prediction: "
        f"{pct(max(errs))}; mean {pct(sum(errs) / len(errs))}. The old arithmetic on the fixed plans: largest "
        f"|error| {pct(max(old))}, mean {pct(sum(old) / len(old))}.\n"
    )
    write_results("sharded", "Sharded plans: ckpt-tune's predicted per-rank peak vs rank 0 measured under the engine",
                  {"rows": data}, body)


if __name__ == "__main__":
    main()
