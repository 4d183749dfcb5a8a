"""measure/sharded.py: rank r's step under FSDP2 / ZeroRedundancyOptimizer, recorded by StepRunner.

Ground truth is tests/sharded_worker.py's `measured_peak` (tests/harness.py's method, DTensor-aware):
the same model under the same engine, set up with torch alone, in a fake process group here and in a
real two-process gloo job (torchrun) for the slow test.

The gloo job is compared by what the training step itself holds (`measured_peaks`' `step`): the
harness's figure without the allocations the process group backend makes for its own use, i.e. those
on another thread than the step's (gloo's worker threads) or inside a `c10d::` collective op on the
step's thread, their frees matched by address. gloo's all-gather gathers into a second full-size buffer
on its worker thread and its reduce-scatter clones the full-size input (sharded_worker.py has the bytes);
NCCL does neither from the caching allocator, and the fake process group, which plays the rank for
measure/sharded.py, allocates nothing (the first test below checks that the rule takes nothing off
there). No free of the step's may go unrecorded (gloo's worker thread frees what it held last out of the
profiler's sight; `released_all_gather` orders that release first): the bytes the step still holds when
the profile ends (`kept`) must agree too.
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

from ckpt_tune.measure import fake_inputs, loader, user_code
from ckpt_tune.measure.runner import StepRunner, StepSettings
from ckpt_tune.measure.sharded import ShardedRunner, ShardingError, fake_process_group
from tests import sharded_worker as w

HERE = Path(__file__).resolve().parent


def harness_peaks(world_size: int, rank: int, shard: str) -> dict:
    """The independent figures (raw, step, lost): the worker's engine with its plan (w.PLAN) and the
    harness, under a fake process group."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        wrap, make_opt = w.engine(shard, init_device_mesh("cpu", (world_size,)), checkpoint=w.PLAN)
        return w.measured_peaks(w.build, w.make_batch, w.loss_fn, w.BATCH, wrap, make_opt)
    finally:
        dist.destroy_process_group()


def harness_peak(world_size: int, rank: int, shard: str) -> int:
    """The independent figure: the harness's peak under a fake process group."""
    return harness_peaks(world_size, rank, shard)["raw"]


def runner_peak(world_size: int, rank: int, shard: str, **kw) -> int:
    """ckpt-tune's figure for rank `rank`: ShardedRunner with the same plan applied before sharding."""
    kw.setdefault("checkpoint", list(w.PLAN))
    with ShardedRunner(w.build(), w.make_batch, w.loss_fn, world_size=world_size, shard=shard, rank=rank, units=w.UNITS, **kw) as r:
        return r.measure(w.BATCH, units=w.UNITS).peak_bytes


@pytest.fixture(scope="module")
def fake_pg_runs() -> dict[tuple[int, str], dict]:
    """(rank, stage) -> the harness figures at world size 2, for both ranks."""
    return {(rank, shard): harness_peaks(2, rank, shard) for rank in (0, 1) for shard in w.STAGES}


@pytest.fixture(scope="module")
def fake_pg_peaks(fake_pg_runs) -> dict[tuple[int, str], int]:
    """(rank, stage) -> the harness figure at world size 2, for both ranks."""
    return {key: run["raw"] for key, run in fake_pg_runs.items()}


def test_the_fake_backend_allocates_nothing(fake_pg_runs):
    """Under the fake process group the step's figure is the harness's whole figure: the rule that the
    gloo comparison applies (leave out the backend's allocations) takes nothing off, and no free is lost."""
    for run in fake_pg_runs.values():
        assert run["step"] == run["raw"]
        assert run["lost"] == 0


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
        return user_code.compute_loss(t, m, b)

    for shard in ("fsdp", "zero1"):
        # no plan: a checkpoint region stashes the CPU random state (5,056 B, a real tensor even under
        # fake tensors), which fake mode does not count (docs/limitations.md)
        real = runner_peak(2, 0, shard, checkpoint=[])
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
def torchrun_peaks(tmp_path_factory) -> dict[tuple[int, str], dict]:
    """(rank, stage) -> that rank's figures (raw, step, lost) in a 2-process gloo job."""
    ranks = _torchrun(tmp_path_factory.mktemp("torchrun") / "peaks")
    return {(r["rank"], shard): peak for r in ranks for shard, peak in r["peaks"].items()}


@pytest.mark.slow
@pytest.mark.parametrize("shard", w.STAGES)
def test_two_gloo_processes_agree_with_the_fake_process_group(shard, torchrun_peaks, fake_pg_runs, fake_pg_peaks):
    """Each rank of a real 2-process job holds, in its training step, exactly the bytes the fake process
    group predicts for it. For fully_shard (fsdp, zero2) that is the harness figure less gloo's own
    collective buffers (module docstring; the whole figure exceeds it by 0 to 0.5 MB, varying with where
    gloo's worker thread runs); ZeroRedundancyOptimizer's collectives are blocking broadcasts that
    allocate nothing, so under zero1 the whole figure agrees too."""
    for rank in (0, 1):
        got = torchrun_peaks[(rank, shard)]
        assert got["lost"] == 0, f"rank {rank}: {got['lost']} frees of the step went unrecorded"
        assert got["kept"] == fake_pg_runs[(rank, shard)]["kept"], f"rank {rank}: a free went unrecorded: {got}"
        assert got["step"] == fake_pg_peaks[(rank, shard)], f"rank {rank}: {got}"
        if shard == "zero1":
            assert got["raw"] == got["step"]


@pytest.mark.parametrize("shard", ["zero2", "zero3"])
def test_gathered_weights_are_not_attributed_as_activations(shard):
    """The bytes a step saves for backward, by module, are the same under fully_shard as without it:
    the weights FSDP2 gathers (and autograd saves) count as parameters, whichever storage they land in."""

    def saved(stage: str) -> dict:
        with ShardedRunner(w.build(), w.make_batch, w.loss_fn, StepSettings(device="cpu"), world_size=2,
                           shard=stage, units=w.UNITS) as r:
            m = r.measure(w.BATCH, units=w.UNITS, attribute=True)
        out: dict = {}
        for nbytes, mod in m.saved.values():
            out[mod] = out.get(mod, 0) + nbytes
        return out

    assert saved(shard) == saved("zero1")


@pytest.mark.parametrize("shard", ["zero3", "zero2"])
def test_fake_optimizer_step_on_local_shards_equals_dtensors(shard, monkeypatch):
    """Under fake tensors the foreach optimizer step runs on the local shards (sharded.LocalForeach):
    the recorded iteration, every allocation and free, is the one DTensor's own dispatch gives."""
    from ckpt_tune.measure import sharded

    t = loader.load_target(str(HERE / "sharded_worker.py") + ":build")
    calls: list[str] = []
    seen = sharded.LocalForeach.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        calls.append(getattr(func, "__name__", ""))
        return seen(self, func, types, args, kwargs)

    def recorded(local: bool):
        if not local:
            monkeypatch.setattr(ShardedRunner, "_optimizer_step", StepRunner._optimizer_step)
        fake = fake_inputs.build_fake_model(t)
        settings = StepSettings(device="meta", precision="bf16-mixed")  # foreach, as on CUDA
        with ShardedRunner(
            fake, fake_inputs.fake_batch_fn(t), lambda m, b: user_code.compute_loss(t, m, b), settings,
            world_size=4, shard=shard, units=w.UNITS,
        ) as r:
            m = r.measure(w.BATCH, units=w.UNITS)
        tl = m.timeline
        return tl.deltas, tl.live, m.peak_bytes, m.static_bytes, m.optimizer_bytes

    monkeypatch.setattr(sharded.LocalForeach, "__torch_function__", counting)
    local = recorded(True)
    assert any(c.startswith("_foreach_") for c in calls)  # the step did run through the mode
    assert local == recorded(False)


@pytest.mark.parametrize("shard", ["zero3", "zero1"])
def test_fake_first_sharded_iteration_is_recorded_as_the_steady_one(shard):
    """The first measure under fake tensors runs no warm-up (runner.measure): rank 0's first iteration,
    less the optimizer state its step made, is the next iteration's to the byte."""
    t = loader.load_target(str(HERE / "sharded_worker.py") + ":build")
    fake = fake_inputs.build_fake_model(t)
    settings = StepSettings(device="meta", precision="bf16-mixed")
    with ShardedRunner(
        fake, fake_inputs.fake_batch_fn(t), lambda m, b: user_code.compute_loss(t, m, b), settings,
        world_size=4, shard=shard, units=w.UNITS,
    ) as r:
        first, second = (r.measure(w.BATCH, units=w.UNITS) for _ in range(2))
    assert first.timeline.deltas == second.timeline.deltas
    assert (first.peak_bytes, first.static_bytes) == (second.peak_bytes, second.static_bytes)
