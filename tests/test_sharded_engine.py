"""measure/sharded.py: rank r's step under FSDP2 / ZeroRedundancyOptimizer, recorded by StepRunner.

Ground truth is tests/sharded_worker.py's `measured_peak` (tests/harness.py's method, DTensor-aware):
the same model under the same engine, set up with torch alone, in a fake process group here and in a
real two-process gloo job (torchrun) for the slow test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from ckpt_tune.measure import fake_inputs, loader
from ckpt_tune.measure.runner import StepRunner, StepSettings
from ckpt_tune.measure.sharded import ShardedRunner, ShardingError, fake_process_group
from tests import sharded_worker as w

HERE = Path(__file__).resolve().parent


def harness_peak(world_size: int, rank: int, shard: str) -> int:
    """The independent figure: the worker's engine and harness under a fake process group."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        wrap, make_opt = w.engine(shard, init_device_mesh("cpu", (world_size,)))
        return w.measured_peak(w.build, w.make_batch, w.loss_fn, w.BATCH, wrap, make_opt)
    finally:
        dist.destroy_process_group()


def runner_peak(world_size: int, rank: int, shard: str, **kw) -> int:
    with ShardedRunner(w.build(), w.make_batch, w.loss_fn, world_size=world_size, shard=shard, rank=rank, units=w.UNITS, **kw) as r:
        return r.measure(w.BATCH, units=w.UNITS).peak_bytes


@pytest.fixture(scope="module")
def fake_pg_peaks() -> dict[tuple[int, str], int]:
    """(rank, stage) -> the harness figure at world size 2, for both ranks."""
    return {(rank, shard): harness_peak(2, rank, shard) for rank in (0, 1) for shard in w.STAGES}


@pytest.mark.parametrize("shard", w.STAGES)
@pytest.mark.parametrize("world_size", [2, 4])
def test_rank0_peak_equals_harness(world_size, shard, fake_pg_peaks):
    expected = fake_pg_peaks[(0, shard)] if world_size == 2 else harness_peak(world_size, 0, shard)
    assert runner_peak(world_size, 0, shard) == expected


def test_rank1_peak_equals_harness(fake_pg_peaks):
    """The fake process group plays any rank; uneven shards (odd vocabulary) make rank 1 differ."""
    got = {shard: runner_peak(2, 1, shard) for shard in ("fsdp", "zero1")}
    assert got == {shard: fake_pg_peaks[(1, shard)] for shard in got}
    assert got["fsdp"] != fake_pg_peaks[(0, "fsdp")]


def test_sharding_is_undone_and_checkpoint_order_does_not_matter():
    """After the runner the model is the plain one again (class, parameters, hooks, no process group),
    and a plan applied before fully_shard records what the same plan applied after it records."""
    model = w.build()
    params = dict(model.named_parameters())
    with StepRunner(w.build(), w.make_batch, w.loss_fn) as r:
        plain = r.measure(w.BATCH).peak_bytes
    with ShardedRunner(model, w.make_batch, w.loss_fn, world_size=2, shard="fsdp", units=w.UNITS, checkpoint=["blocks.0"]) as r:
        before = r.measure(w.BATCH, units=w.UNITS)
    with ShardedRunner(model, w.make_batch, w.loss_fn, world_size=2, shard="fsdp", units=w.UNITS) as r:
        after = r.measure(w.BATCH, checkpoint=["blocks.0"], units=w.UNITS)
    assert before.peak_bytes == after.peak_bytes
    assert before.timeline.live == after.timeline.live
    assert type(model) is type(w.build())
    assert not dist.is_initialized()
    assert all(p is params[n] and type(p) is torch.nn.Parameter for n, p in model.named_parameters())
    assert not model._forward_pre_hooks
    assert not model.blocks[0]._forward_hooks
    assert "forward" not in model.blocks[0].__dict__  # the checkpoint wrapper is gone too
    with StepRunner(model, w.make_batch, w.loss_fn) as r:
        assert r.measure(w.BATCH).peak_bytes == plain


def test_markers_follow_fsdp_hooks():
    """f> comes after the unit's all-gather, f< after its reshard (docs in measure/sharded.py)."""
    with ShardedRunner(w.build(), w.make_batch, w.loss_fn, world_size=2, shard="fsdp", units=w.UNITS) as r:
        m = r.measure(w.BATCH, units=w.UNITS)
    tl = m.timeline
    gathered = tl.live_at(tl.marker("f>blocks.1")) - tl.live_at(tl.marker("f<blocks.0"))
    block = sum(p.numel() * 4 for p in w.build().blocks[1].parameters())
    assert block <= gathered < block + 4096  # the block's unsharded parameters (plus alignment)


def test_fake_tensors_record_the_sharded_step_as_the_cpu_does():
    """Under fake tensors with the CPU allocator's rules the sharded step's peak is the allocator's."""
    t = loader.load_target(str(HERE / "sharded_worker.py") + ":build")

    def loss(m, b):
        return loader.compute_loss(t, m, b)

    for shard in ("fsdp", "zero1"):
        real = runner_peak(2, 0, shard)
        fake = fake_inputs.build_fake_model(t)
        settings = StepSettings(device="meta", fake_target="cpu")
        with ShardedRunner(fake, fake_inputs.fake_batch_fn(t), loss, settings, world_size=2, shard=shard, units=w.UNITS) as r:
            assert r.measure(w.BATCH, units=w.UNITS).peak_bytes == real


def test_refuses_a_second_process_group():
    with fake_process_group(2), pytest.raises(ShardingError, match="already exists"):
        runner_peak(2, 0, "fsdp")
    assert not dist.is_initialized()


def _torchrun(out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(HERE / "sharded_worker.py"), str(out)]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=300)
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def torchrun_peaks(tmp_path_factory) -> dict[tuple[int, str], int]:
    ranks = _torchrun(tmp_path_factory.mktemp("torchrun") / "peaks")
    return {(r["rank"], shard): peak for r in ranks for shard, peak in r["peaks"].items()}


@pytest.mark.slow
def test_two_gloo_processes_agree_with_the_fake_process_group(torchrun_peaks, fake_pg_peaks):
    """Each rank of a real 2-process job measures what the fake process group predicts for it (zero1:
    ZeroRedundancyOptimizer, whose collectives are blocking broadcasts)."""
    for rank in (0, 1):
        assert torchrun_peaks[(rank, "zero1")] == fake_pg_peaks[(rank, "zero1")]


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["fsdp", "zero2"])
@pytest.mark.xfail(
    reason="FSDP2 under gloo: the collectives complete on gloo's threads, and the peak a rank records "
    "varies between runs (fsdp rank 0 +66,560 B, rank 1 +0.2 to +0.5 MB; zero2 rank 0 0 or +73,728 B over "
    "the fake process group, whose collectives complete at once). Not yet explained: see "
    "benchmarks/results/sharded.md",
    strict=False,
)
def test_two_gloo_processes_fully_shard(shard, torchrun_peaks, fake_pg_peaks):
    for rank in (0, 1):
        assert torchrun_peaks[(rank, shard)] == fake_pg_peaks[(rank, shard)]
