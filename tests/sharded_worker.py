"""Ground truth for the sharded engine (tests/test_sharded_engine.py): one rank's peak, measured
independently of ckpt_tune, in this process or in each process of a real `torchrun` job.

`measured_peak` is tests/harness.py's (the profiler runs from before the warm-up iteration; the peak is
the bytes live before it plus the largest running sum of CPU allocator events in the measured
iteration; a DTensor parameter counts by its local shard), with the optimizer built by the caller, so
that FSDP2 (`fully_shard`) and `ZeroRedundancyOptimizer` can be measured. `engine` sets a model up for a
stage the way issue 15 defines it, with torch alone.

Run under torchrun (gloo, CPU), every rank writes its peaks per stage to OUT.rank<r>.json:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/sharded_worker.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))

import gpt  # noqa: E402

from tests import harness  # noqa: E402

# small, with odd first dimensions (vocabulary, positions), so that shards are uneven over 2 ranks
CFG = {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 33, "vocab_size": 251}
UNITS = ("blocks.0", "blocks.1")
BATCH = 2
STAGES = ("fsdp", "zero2", "zero1")


def build():
    return gpt.build(**CFG)


def make_batch(b: int):
    return gpt.make_batch(b, **CFG)


loss_fn = gpt.loss_fn


def engine(shard: str, mesh, units=UNITS):
    """(wrap, make_optimizer) for a stage: fully_shard on each unit and the root (zero3/fsdp: reshard
    after forward; zero2: not), or ZeroRedundancyOptimizer over AdamW (zero1)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def adamw(params):
        return torch.optim.AdamW(params, lr=0.0)

    if shard == "zero1":
        return None, lambda params: ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=0.0)
    reshard = shard in ("zero3", "fsdp")

    def wrap(model):
        for name in units:
            fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)

    return wrap, adamw


def measured_peak(build, make_batch, loss_fn, batch_size: int, wrap=None, make_optimizer=None, steps: int = 2) -> int:
    """tests/harness.py's peak of a freshly built (and wrapped) model, the optimizer built by the caller."""
    return harness.measured_peak(
        build, make_batch, loss_fn, batch_size, wrap=wrap, optimizer=make_optimizer or "adamw", steps=steps
    )


def main(out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    peaks = {}
    for shard in STAGES:
        wrap, make_opt = engine(shard, mesh)
        peaks[shard] = measured_peak(build, make_batch, loss_fn, BATCH, wrap, make_opt)
        dist.barrier()
    Path(f"{out}.rank{rank}.json").write_text(json.dumps({"rank": rank, "world_size": world, "peaks": peaks}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
