"""`search --world-size N --shard S` on cpu records rank 0 under PyTorch's engine (measure/sharded.py)
and plans on it: the plan's predicted per-rank peak equals rank 0's peak measured by the independent
harness (tests/sharded_worker.py: torch.profiler's allocator events, engine set up with torch alone),
out of the search's sight, and is within the budget; the plan file records the sharding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from typer.testing import CliRunner

import ckpt_tune
from ckpt_tune.cli import app
from ckpt_tune.measure.session import Settings
from ckpt_tune.plan.entry import to_data
from ckpt_tune.plan.file import load_plan
from tests import harness
from tests import sharded_worker as w

HERE = Path(__file__).resolve().parent
SPEC = str(HERE / "sharded_worker.py") + ":build"
UNITS = list(w.UNITS)
BATCH = 4


def harness_peak(world_size: int, shard: str, checkpoint) -> int:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        wrap_engine, make_opt = w.engine(shard, init_device_mesh("cpu", (world_size,)), UNITS)

        def wrap(model):
            if checkpoint:  # checkpoint wrappers before sharding, as the plan's patch does
                harness.wrap_blocks(model, checkpoint)
            if wrap_engine is not None:
                wrap_engine(model)

        return w.measured_peak(w.build, w.make_batch, w.loss_fn, BATCH, wrap, make_opt)
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module:UserWarning")  # the logits are a view
# zero3 holds every engine buffer; zero1 and zero2 are make test-heavy
@pytest.mark.parametrize("shard", [pytest.param("zero1", marks=pytest.mark.heavy), pytest.param("zero2", marks=pytest.mark.heavy), "zero3"])
def test_sharded_plan_is_exact_and_within_budget(shard):
    none, every = harness_peak(2, shard, []), harness_peak(2, shard, UNITS)
    assert every < none
    budget = (none + every) // 2
    out = ckpt_tune.search(SPEC, vram=f"{budget}B", batch_size=BATCH, world_size=2, shard=shard,
                           settings=Settings(device="cpu"), candidates=frozenset({"blocks"}))
    plan = out.plan
    assert (plan.world_size, plan.shard, plan.sharding) == (2, shard, "measured")
    assert plan.shard_units == (tuple(UNITS) if shard != "zero1" else ())
    assert plan.checkpoint, "the budget lies between every block and nothing checkpointed"
    measured = harness_peak(2, shard, to_data(plan.checkpoint))
    assert plan.predicted_peak_bytes == measured
    assert measured <= budget


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module:UserWarning")
def test_cli_writes_a_sharded_plan_that_loads_and_a_patch_that_shards(tmp_path):
    out = tmp_path / "plan.yaml"
    r = CliRunner().invoke(app, ["search", SPEC, "--vram", "1GiB", "--batch-size", "2", "--world-size", "2",
                                 "--shard", "fsdp", "--device", "cpu", "--candidates", "blocks", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "recorded under the real engine" in r.output
    plan = load_plan(out)
    assert (plan.world_size, plan.shard, plan.sharding, plan.shard_units) == (2, "fsdp", "measured", tuple(UNITS))
    assert "fully_shard" in r.output  # the patch shards after it checkpoints
    assert not dist.is_initialized()
