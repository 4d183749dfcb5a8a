"""Ground truth for the sharded engine (tests/test_sharded_engine.py): one rank's peak, measured
independently of ckpt_tune, in this process or in each process of a real `torchrun` job.

`measured_peak` is tests/harness.py's (the profiler runs from before the warm-up iteration; the peak is
the bytes live before it plus the largest running sum of CPU allocator events in the measured
iteration; a DTensor parameter counts by its local shard), with the optimizer built by the caller, so
that FSDP2 (`fully_shard`) and `ZeroRedundancyOptimizer` can be measured. `engine` sets a model up for a
stage the way issue 15 defines it, with torch alone.

`measured_peaks` runs that same harness and reads its profile a second time, by owner (`step_peak`):
the step's figure leaves out the process group backend's own allocations. Under the fake process group
it is the harness figure (the fake backend allocates nothing); under gloo it is what the training step
itself holds. Why gloo needs this, measured with torch 2.13 (gloo, 2 ranks, this file's model):

- gloo's collectives allocate temporaries from the CPU allocator that FSDP2 never asked for, none of
  which a CUDA/NCCL job allocates from the caching allocator (NCCL writes into FSDP's buffers):
  `all_gather_into_tensor` allocates a second full-size output on gloo's worker thread (`gloo:all_gather`:
  it gathers into a flat temporary and copies out; 199,936 B for a block here, 73,728 B for the root) and
  allocates and frees one more at once on the calling thread inside `c10d::_allgather_base_` (as the
  work's `getOutputTensors()`, a new flat tensor in PyTorch's source, would); `reduce_scatter_tensor`
  clones its full-size input on the calling thread (`c10d::_reduce_scatter_base_` -> `aten::clone`),
  all-reduces the clone on the worker thread and keeps it until the work is released; an average adds
  8 + 4 B scalars on the worker thread. Where the worker
  thread runs its part against the step (FSDP2 prefetches in backward) varies from run to run, hence
  the varying excess of the raw figure (0 to +466,432 B; the raw peak is often the moment of the
  calling thread's 199,936 B, 66,560 B above the step's own peak).
- the profiler records an allocation or free only on a thread that carries its state: gloo's worker
  thread does while it runs a collective, not afterwards, when it lets go of the finished work. When
  FSDP2 drops an all-gather buffer before that (a race), the buffer's last reference, and so its free,
  goes with the work on the worker thread, unrecorded: the harness counts the buffer live for the rest
  of the profile (in 9 of 12 jobs without `released_all_gather` a rank's step figure exceeded the fake
  group's by such buffers: 73,728 B, the root's, or 199,936 B, a block's, each).
  `released_all_gather` makes FSDP2's all-gather return only once gloo has let go of the buffer, so
  that FSDP2's own release is the last one, on the step's thread, where it is recorded. A free gone
  unrecorded shows as a step allocation whose address is allocated again while it is live (`lost`) or,
  in any case, as more bytes still held at the end (`kept`); the test requires neither.

Run under torchrun (gloo, CPU), every rank writes its figures per stage to OUT.rank<r>.json:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/sharded_worker.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

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
PLAN = ("blocks.1",)  # the checkpoint plan the two-process job runs with (applied before sharding)
STAGES = ("fsdp", "zero2", "zero1")


def build():
    return gpt.build(**CFG)


def make_batch(b: int):
    return gpt.make_batch(b, **CFG)


loss_fn = gpt.loss_fn


def released_all_gather():
    """FSDP2's default all-gather (same buffer, same collective, same `async_op`), returning only once
    the backend holds no reference to the all-gather buffer any more.

    gloo's work keeps views of the output (and the input, a slice of it) until its worker thread lets go
    of the finished work, which can come after FSDP2 has dropped the buffer; the free then happens on
    that thread, where the profiler does not record it. Waiting here until the buffer's storage has no
    more users than before the call (FSDP2's own) changes no allocation: it only orders gloo's release
    before FSDP2's. With the fake process group nothing holds the buffer, and nothing is waited for."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class ReleasedAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            storage = output_tensor.untyped_storage()
            users = torch._C._storage_Use_Count(storage._cdata)
            work = super().__call__(output_tensor, input_tensor, group, async_op)
            if work is not None:
                work.wait()
                del work
            deadline = time.monotonic() + 60
            while torch._C._storage_Use_Count(storage._cdata) > users:
                if time.monotonic() > deadline:
                    raise RuntimeError("the process group still holds the all-gather buffer after 60 s")
                os.sched_yield()
            return None

    return ReleasedAllGather()


def engine(shard: str, mesh, units=UNITS, checkpoint=()):
    """(wrap, make_optimizer) for a stage: `checkpoint` (a plan's entries) wrapped first, as a user's
    script applies a plan before sharding; then fully_shard on each unit and the root (zero3/fsdp:
    reshard after forward; zero2: not), each with `released_all_gather`, or ZeroRedundancyOptimizer
    over AdamW (zero1)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def adamw(params):
        return torch.optim.AdamW(params, lr=0.0)

    if shard == "zero1":
        wrap_plan = (lambda model: harness.wrap_blocks(model, checkpoint)) if checkpoint else None
        return wrap_plan, lambda params: ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=0.0)
    reshard = shard in ("zero3", "fsdp")

    def wrap(model):
        if checkpoint:
            harness.wrap_blocks(model, checkpoint)
        sharded = [fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=reshard) for name in units]
        sharded.append(fully_shard(model, mesh=mesh, reshard_after_forward=reshard))
        for module in sharded:
            module.set_custom_all_gather(released_all_gather())

    return wrap, adamw


def measured_peak(build, make_batch, loss_fn, batch_size: int, wrap=None, make_optimizer=None, steps: int = 2) -> int:
    """tests/harness.py's peak of a freshly built (and wrapped) model, the optimizer built by the caller."""
    return harness.measured_peak(
        build, make_batch, loss_fn, batch_size, wrap=wrap, optimizer=make_optimizer or "adamw", steps=steps
    )


def measured_peaks(build, make_batch, loss_fn, batch_size: int, wrap=None, make_optimizer=None, steps: int = 2) -> dict:
    """`measured_peak` (`raw`: the harness's figure, every allocator event) and, from the same profile,
    `step`: the same figure without the backend's allocations (`step_peak`); `kept`: the bytes the step's
    allocations still hold when the profile ends (gradient shards, optimizer state), which a free gone
    unrecorded would raise; `lost`: the step's allocations seen freed unrecorded (their address allocated
    again while they were live)."""
    profiles = []

    class Kept(harness.profile):  # the harness's profiler, kept for a second reading
        def __enter__(self):
            profiles.append(self)
            return super().__enter__()

    with mock.patch.object(harness, "profile", Kept):
        raw = measured_peak(build, make_batch, loss_fn, batch_size, wrap, make_optimizer, steps)
    (prof,) = profiles
    events, excess, kept, lost = step_peak(prof)
    assert events == harness_events_peak(prof), "the event tree must hold the harness's events"
    return {"raw": raw, "step": raw - excess, "kept": kept, "lost": lost}


def harness_events_peak(prof) -> int:
    """tests/harness.py's reading of the profile (its peak without the bytes live before profiling)."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() in ("[memory]", harness.MARK)]
    events.sort(key=lambda e: e.start_ns())
    live, peak, started = 0, 0, False
    for e in events:
        if e.name() == harness.MARK:
            started, peak = True, live
            continue
        if e.device_type() == torch.autograd.DeviceType.CPU:
            live += e.nbytes()
        if started:
            peak = max(peak, live)
    return peak


def step_peak(prof) -> tuple[int, int, int, int]:
    """(peak of every CPU allocator event, what leaving out the backend's allocations takes off it, the
    step's bytes live at the end, frees of the step's allocations seen to go unrecorded), from the
    profiler's event tree.

    An allocation is the backend's when it is made on another thread than the step's (the thread that
    recorded harness.MARK: gloo's worker threads) or inside a `c10d::` collective op on the step's thread
    (the process group's implementation: FSDP2 passes its own output buffers in). A free belongs to its
    allocation, matched by address; one without (an allocation from before profiling) is the step's."""
    from torch._C._profiler import _EventType

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    nodes = list(walk(prof.profiler.kineto_results.experimental_event_tree()))
    (mark,) = [n for n in nodes if n.name == harness.MARK]

    def backend(node) -> bool:
        if node.start_tid != mark.start_tid:
            return True
        parent = node.parent
        while parent is not None:
            if parent.name.startswith("c10d::"):
                return True
            parent = parent.parent
        return False

    allocs = [n for n in nodes if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu"]
    allocs.sort(key=lambda n: n.start_time_ns)
    owner: dict[int, bool] = {}  # address -> allocated by the backend, while live
    live = {"raw": 0, "step": 0}
    peak = dict(live)
    started, lost = False, 0
    for n in allocs:
        if not started and n.start_time_ns >= mark.start_time_ns:
            started, peak = True, dict(live)
        ptr, size = n.extra_fields.ptr, n.extra_fields.alloc_size
        if size > 0:
            if owner.get(ptr) is False:
                lost += 1  # a live allocation of the step at this address was freed unrecorded
            owner[ptr] = by_backend = backend(n)
        else:
            by_backend = owner.pop(ptr, False)
        live["raw"] += size
        if not by_backend:
            live["step"] += size
        if started:
            peak = {k: max(peak[k], live[k]) for k in live}
    return peak["raw"], peak["raw"] - peak["step"], live["step"], lost


def main(out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    peaks = {}
    for shard in STAGES:
        wrap, make_opt = engine(shard, mesh, checkpoint=PLAN)
        peaks[shard] = measured_peaks(build, make_batch, loss_fn, BATCH, wrap, make_opt)
        dist.barrier()
    Path(f"{out}.rank{rank}.json").write_text(json.dumps({"rank": rank, "world_size": world, "peaks": peaks}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
