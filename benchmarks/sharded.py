"""Sharded data parallelism: rank 0's measured peak under PyTorch's engines vs today's arithmetic.

For each model, world size (2, 4, 8), stage (zero1, zero2, zero3) and checkpoint plan (none, every
block): the peak of rank 0 measured under the real engine in a fake process group (FSDP2 `fully_shard`
per block and at the root, reshard_after_forward True for zero3 and False for zero2;
`ZeroRedundancyOptimizer` over AdamW for zero1), by tests/sharded_worker.py's harness (the CPU
allocator's events, no ckpt_tune code; checkpoint wrappers from tests/harness.py applied before
sharding), against what `search --world-size N --shard S` predicts today: the single-device memory
model's terms at the same batch (tune/searcher.py probes) passed through tune/sharding.py's
`per_gpu_terms`, and `predict` for the same plan. The gap is what issue 15 is about; this table is the
baseline the measured-terms integration is judged against.

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

from ckpt_tune.measure import loader  # noqa: E402
from ckpt_tune.measure.runner import StepRunner  # noqa: E402
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


def measured(target, units, batch: int, world_size: int, shard: str, checkpoint) -> int:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        wrap_engine, make_opt = sharded_worker.engine(shard, init_device_mesh("cpu", (world_size,)), units)

        def wrap(model):
            if checkpoint:
                harness.wrap_blocks(model, checkpoint)
            if wrap_engine is not None:
                wrap_engine(model)

        def make_optimizer(params):
            return make_opt(params) if shard == "zero1" else torch.optim.AdamW(params, lr=0.0)

        return sharded_worker.measured_peak(
            lambda: loader.build_model(target), lambda b: loader.make_batch(target, b),
            lambda m, b: loader.compute_loss(target, m, b), batch, wrap, make_optimizer,
        )
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="gpt only, world size 4")
    ap.add_argument("--allow-dirty", action="store_true")
    args = ap.parse_args()
    models = {"gpt": MODELS["gpt"]} if args.quick else MODELS
    worlds = (4,) if args.quick else WORLD_SIZES
    rows, data = [], []
    for name, (spec, batch) in models.items():
        target = loader.load_target(spec)
        runner = StepRunner(loader.build_model(target), lambda b, t=target: loader.make_batch(t, b),
                            lambda m, b, t=target: loader.compute_loss(t, m, b))
        with runner:
            s = Searcher(runner)
            s.order_units(batch)
            terms = s.terms(batch)
            params, opt, _grads = runner.state_bytes()
            gathered = s.gathered_bytes()
            plans = {"none": (0,) * len(s.units), "every block": (1,) * len(s.units)}
            names = {k: s.names(c) for k, c in plans.items()}
            units = s.units
        for plan, choice in plans.items():
            ckpt = [e.modules[0] if len(e.modules) == 1 else tuple(e.modules) for e in names[plan]]
            single = measured_single = sharded_worker.measured_peak(
                lambda t=target: loader.build_model(t), lambda b, t=target: loader.make_batch(t, b),
                lambda m, b, t=target: loader.compute_loss(t, m, b), batch,
                (lambda m, c=ckpt: harness.wrap_blocks(m, c)) if ckpt else None)
            for w in worlds:
                for shard in STAGES:
                    t0 = time.perf_counter()
                    arith = predict(per_gpu_terms(terms, params, opt, w, shard, gathered), choice)
                    meas = measured(target, units, batch, w, shard, ckpt)
                    err = (arith - meas) / meas
                    row = {"model": name, "batch": batch, "checkpoint": plan, "world_size": w, "shard": shard,
                           "single_device_peak": single, "arithmetic_peak": arith, "measured_rank0_peak": meas,
                           "arithmetic_error": round(err, 5), "seconds": round(time.perf_counter() - t0, 1)}
                    data.append(row)
                    rows.append([name, batch, plan, w, shard, mib(measured_single), mib(arith), mib(meas), pct(err)])
                    print(row, file=sys.stderr, flush=True)
    errs = [abs(r["arithmetic_error"]) for r in data]
    body = (
        "Rank 0's peak measured under the real engine (fake process group, CPU allocator events, "
        "tests/sharded_worker.py) vs the arithmetic of `search --world-size N --shard S` today "
        "(single-device terms through tune/sharding.py `per_gpu_terms`, then `predict`). MiB; error = "
        "(arithmetic - measured) / measured: positive is conservative, negative is a plan that would "
        "not fit.\n\n"
        + md_table(["model", "batch", "checkpoint", "world", "stage", "1 device", "arithmetic", "measured rank 0", "error"], rows)
        + f"\n\nLargest |error|: {pct(max(errs))}; mean |error|: {pct(sum(errs) / len(errs))}.\n"
    )
    write_results("sharded", "Sharded steps: measured rank-0 peak vs per_gpu_terms arithmetic", {"rows": data}, body)


if __name__ == "__main__":
    main()
