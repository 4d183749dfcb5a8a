"""One rank's training iteration under PyTorch's own sharding engines, recorded like any other step.

`search`/`diagnose --world-size N --shard S` used to divide a single-device step by arithmetic
(tune/sharding.py). Here the step runs under the real engine instead: a *fake process group*
(`torch.testing._internal.distributed.fake_pg`: every collective returns at once and moves no data)
lets one CPU process play rank r of N. FSDP2's `fully_shard` then keeps 1/N of each parameter, allocates
its all-gather and reduce-scatter buffers, unshards the block being computed and prefetches the next,
exactly as on rank r of a real job; `ZeroRedundancyOptimizer` keeps rank r's share of the optimizer
state. The CPU allocator (or `FakeRecorder` under fake tensors) sees every one of those buffers, so
`StepRunner.measure` records rank r's step, its timeline, markers and peak, unchanged
(docs/design.md §3, §6).

    with ShardedRunner(model, batch_fn, loss_fn, StepSettings(), world_size=8, shard="zero3") as r:
        m = r.measure(batch_size, units=blocks)      # rank 0's Measurement

The stages (issue 15; `ENGINES`, from plan/shard.py: the calls `ckpt_tune.shard` and the patch snippet
make for a plan of several ranks):

    zero3, fsdp  fully_shard(block, reshard_after_forward=True) for every unit, then the root
    zero2        the same with reshard_after_forward=False: parameters stay gathered from forward
                 to backward; gradients and optimizer state are sharded
    zero1        the model as it is, and ZeroRedundancyOptimizer(optimizer_class=...) over its
                 parameters: rank r keeps the state of its partition, gradients stay whole

`bf16-mixed` (and `fp16-mixed`) under fully_shard is FSDP2's `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`, not autocast: the all-gather casts the sharded fp32 parameters to bf16 and the
reduce-scatter runs in fp32. Under zero1 it stays autocast, as on one device. `bf16` (pure) casts the
model before it is sharded.

**Set-up and teardown.** `fake_process_group(N, rank)` initialises the default process group with the
fake backend and a 1-D CPU device mesh, and destroys it on exit; it refuses to run where a process group
already exists (under torchrun the real one is the user's). `shard_model` shards a model in place and
returns a `ShardedModel` whose `restore()` puts back what fully_shard changed: each module's class (FSDP
swaps in an `FSDP<Class>` subclass), its original `nn.Parameter` objects (FSDP registers sharded DTensor
parameters in their place, and leaves the originals untouched), the forward hooks it added, and its
composable-API state. After `ShardedRunner.__exit__` the model is the one passed in, trainable on one
device, and another `ShardedRunner` (any world size or stage) can run in the same process.

**Checkpoint wrappers go on before sharding.** `ShardedRunner(checkpoint=plan)` applies the plan
(ckpt_tune.plan.apply) to the plain model, then shards it, as a user's script does. `measure(checkpoint=...)`
on an already sharded model applies it after: `apply` replaces the instance's `forward` and FSDP2 never
touches `forward` (its hooks live in `__call__`), so both orders record the same bytes; the tests check
this. Segments (plan/segment.py) do not compose with per-block shard units: a segment's recompute calls
its blocks' forwards directly, without the pre-forward hook that all-gathers their parameters, so every
block of a segment must be in one shard unit (`fully_shard([b3, b4, b5])`), which `units` can express as
a tuple of names.

**Markers under FSDP2** (measure/instrument.py `Instrument`, found by recording): FSDP2 registers its
forward pre-hook with `prepend=True` and its post-hook at `fully_shard` time, before the runner's hooks
exist. So on a shard unit:

- `f>name` comes after the unit's all-gather: its unsharded parameters (and, with
  reshard_after_forward=True, nothing else of FSDP's) are already live when the block's forward starts;
  the root's pre-forward (lazy init, the first unit's unshard) precedes the first marker;
- `f<name` comes after FSDP's post-forward: with reshard_after_forward=True the unit's unsharded
  parameters are already freed; with False they stay live until backward;
- `b>name` (a tensor hook on the unit's first output) fires after FSDP's own pre-backward hook on that
  output, which all-gathers the unit again (zero3) and prefetches the next unit in backward order; the
  unit's reduce-scatter (its gradients' full-size buffer and the shard) happens in its post-backward,
  before the next unit's `b>` marker;
- the reduce-scatter of the last unit in backward (the root) and the post-backward callback that
  finalises every sharded gradient run before `loss.backward()` returns, so before the `backward`
  marker; the optimizer step works on the shards (DTensors; `state_bytes` counts their local tensors).

So a block's forward term (its `f>`..`f<` window) includes its own all-gather buffer but not its free;
the memory model's cut of a sharded step is the same cut at the same markers, and the bytes FSDP holds
between them are in the timeline.

**Against a real job** (tests/test_sharded_engine.py, slow). In a two-process `torchrun` gloo job each
rank's step holds exactly the bytes the fake process group gives for that rank (fsdp, zero2, zero1, both
ranks of an uneven split). The CPU allocator there also sees gloo's own collective buffers, which the fake
group (and NCCL, from the caching allocator) does not allocate: `all_gather_into_tensor` gathers into a
second full-size buffer on gloo's worker thread and `reduce_scatter_tensor` clones its full-size input,
so the whole-process figure exceeds the step's by 0 to 0.5 MB on that small model, varying with where the
worker thread runs against the step; and a buffer whose last reference gloo's worker thread drops is
freed where the profiler does not record it. The comparison therefore leaves out allocations made on
the backend's threads or inside a `c10d::` collective op, and makes FSDP2's all-gather return once gloo
has let go of the buffer (tests/sharded_worker.py has the bytes and the rule). What is recorded here is the
step's; a backend's scratch, on CPU, is on top of it.

**Fake tensors** (`--device meta`, measure/fake.py). FSDP2 and ZeroRedundancyOptimizer run under the
project's FakeTensorMode with the fake process group: fully_shard chunks fake parameters, the
collectives of the fake group accept fake tensors, and the step runs. Two conditions, both handled here:
the process group and its DeviceMesh are made outside fake mode (`init_device_mesh` reads a tensor it
built: `.tolist()` is data-dependent under fake tensors), and `FakeRecorder` is helped to see what FSDP2
allocates without an op (`fake_fsdp_recording`: DTensor results, and `UntypedStorage.resize_`, by which
FSDP2 allocates and frees unsharded parameters). With that, fake mode with the CPU allocator's rules
records the sharded step of a small GPT (fp32; zero1, zero2, zero3) to the byte, at every marker. Under
`MixedPrecisionPolicy(bf16)` it misses the fp32 scratch that the CPU's bf16 matmul kernels allocate
(3-7% of that small model's peak); that scratch is the CPU's, not CUDA's, which `--device meta` sizes.
Measured (2 cores, other work running, benchmarks/results/sharded.md): Llama-2-7B seq 4096 bf16-mixed
AdamW ZeRO-3 x8, batch 1, every layer but the last checkpointed: 15.69 GiB in 173 s, 425 MiB RSS (none
checkpointed 34.64 GiB, 38 s); Llama-2-70B the same x64: 27.39 GiB in 199 s, 459 MiB RSS.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from ckpt_tune import vocab
from ckpt_tune.errors import CkptTuneError
from ckpt_tune.measure import fake_inputs
from ckpt_tune.measure.runner import Measurement, StepRunner, StepSettings
from ckpt_tune.measure.tensors import local_tensor, unique_bytes
from ckpt_tune.plan import apply as plan_apply
from ckpt_tune.plan import shard as plan_shard

# the stages' engines and mixed precisions are the plan's (plan/shard.py): the step is recorded under
# the calls `ckpt_tune.shard` and the patch snippet make
ENGINES = plan_shard.ENGINES
MIXED = plan_shard.MIXED


class ShardingError(CkptTuneError):
    """The sharded step cannot be set up here (a process group exists, a stage or precision is unknown)."""


def check_stage(world_size: int, shard: str) -> None:
    if shard not in ENGINES:
        raise ShardingError(f"unknown shard stage {shard!r}", f"use one of {', '.join(ENGINES)}")
    if world_size < 2:
        raise ShardingError(f"a sharded step needs a world size of at least 2, got {world_size}", "e.g. world_size=8")


# -- the fake process group -----------------------------------------------------------------------


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[Any]:
    """The default process group as rank `rank` of `world_size`, with the fake backend (no data moves),
    and its 1-D CPU DeviceMesh; destroyed on exit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ShardingError(f"rank {rank} is not in a world of {world_size}", f"use a rank in 0..{world_size - 1}")
    if dist.is_initialized():
        raise ShardingError(
            "a process group already exists in this process: the fake one cannot replace it",
            "record sharded steps in a process that has not called init_process_group (not under torchrun)",
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


# -- sharding a model in place, and undoing it ---------------------------------------------------------


def default_units(model: nn.Module) -> tuple[str, ...]:
    """Shard units when none are given: the children of the outermost ModuleList/Sequential containers
    whose children repeat a class and hold parameters (a transformer's layers). The planner's blocks
    (tune/candidates.find_blocks) are the better choice and the search passes them."""
    out: list[str] = []

    def visit(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            full = f"{prefix}{name}"
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                kids = [(n, c) for n, c in child.named_children() if any(True for _ in c.parameters())]
                classes = [type(c) for _, c in kids]
                if len(kids) >= 2 and any(classes.count(c) >= 2 for c in classes):
                    out.extend(f"{full}.{n}" for n, _ in kids)
                    continue
            visit(full + ".", child)

    visit("", model)
    return tuple(out)


@dataclass
class ShardedModel:
    """A model sharded in place (`shard_model`); `restore()` undoes it."""

    model: nn.Module
    world_size: int
    shard: str
    rank: int
    units: tuple[str | tuple[str, ...], ...]
    mp_dtype: torch.dtype | None = None
    _saved: list = field(default_factory=list, repr=False)
    _restored: bool = False

    def restore(self) -> None:
        if self._restored:
            return
        from torch.distributed import _composable_state as cstate

        for mod, cls, params, hooks, keys in self._saved:
            mod.__class__ = cls
            mod._parameters.clear()
            mod._parameters.update(params)
            for attr, saved in hooks.items():
                d = getattr(mod, attr)
                d.clear()
                d.update(saved)
            for k in [k for k in mod.__dict__ if k not in keys]:
                del mod.__dict__[k]
            cstate._module_state_mapping.pop(mod, None)
        self._saved.clear()
        self._restored = True


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def shard_model(
    model: nn.Module,
    mesh: Any,
    shard: str,
    units: Sequence[str | Sequence[str]] | None = None,
    precision: str = "fp32",
) -> ShardedModel:
    """Apply FSDP2 to `model` in place for a fully_shard stage: every unit (a module name, or a tuple of
    names sharded as one group), then the root. For zero1 nothing changes on the model (the runner wraps
    the optimizer). Returns the handle whose `restore()` undoes it."""
    world_size = mesh.size()
    check_stage(world_size, shard)
    units_t = tuple(u if isinstance(u, str) else tuple(u) for u in (default_units(model) if units is None else units))
    handle = ShardedModel(model, world_size, shard, mesh.get_rank(), units_t)
    if ENGINES[shard][0] != "fully_shard":
        return handle
    handle._saved = [
        (m, m.__class__, dict(m._parameters), {a: dict(getattr(m, a)) for a in _HOOK_DICTS}, set(m.__dict__))
        for m in model.modules()
    ]
    handle.mp_dtype = MIXED.get(precision)
    try:
        plan_shard.fully_shard_units(model, units_t, mesh, shard, precision)
    except BaseException:
        handle.restore()
        raise
    return handle


def zero_optimizer(params: list, optimizer: str, foreach: bool | None = None):
    """ZeroRedundancyOptimizer over `params` with the registered optimizer's class and settings (lr 0)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    probe = vocab.optimizer(optimizer).make(params[:1], foreach)
    if probe is None:
        return None
    accepted = inspect.signature(type(probe).__init__).parameters
    defaults = {k: v for k, v in probe.defaults.items() if k in accepted and k != "params"}
    return ZeroRedundancyOptimizer(params, optimizer_class=type(probe), **defaults)


# -- the runner ---------------------------------------------------------------------------------------


class ShardedRunner(StepRunner):
    """A StepRunner for rank `rank` of `world_size` under stage `shard`: on enter, a fake process group,
    the checkpoint plan, then the engine (fully_shard, or ZeroRedundancyOptimizer); on exit all undone.
    `measure`, `time_step`, `state_bytes` are StepRunner's, on this rank's tensors."""

    def __init__(
        self,
        model: nn.Module,
        batch_fn: Callable[[int], Any],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        settings: StepSettings = StepSettings(),
        *,
        world_size: int,
        shard: str,
        rank: int = 0,
        units: Sequence[str | Sequence[str]] | None = None,
        checkpoint: Sequence = (),
    ) -> None:
        check_stage(world_size, shard)
        if settings.device not in ("cpu", "meta"):
            raise ShardingError(
                f"sharded steps are recorded on the CPU or under fake tensors, not on {settings.device}",
                "use --device cpu or --device meta",
            )
        super().__init__(model, batch_fn, loss_fn, settings)
        self.world_size, self.shard, self.rank = world_size, shard, rank
        self.units = units
        self.checkpoint = list(checkpoint)
        self.sharded: ShardedModel | None = None
        self._pg: contextlib.AbstractContextManager | None = None
        self._mesh: Any = None
        self._cast_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._quiet: contextlib.AbstractContextManager | None = None

    @property
    def engine(self) -> str:
        return ENGINES[self.shard][0]

    def __enter__(self) -> ShardedRunner:
        # FSDP2's advice on a model whose output is a view: silenced for every step the runner runs
        # (measure, time_step, and whatever else calls the sharded model while it is entered)
        self._quiet = _quiet()
        self._quiet.__enter__()
        try:
            # the process group and its mesh are process state, made of real tensors: outside fake mode
            pg = fake_process_group(self.world_size, self.rank)
            self._mesh = pg.__enter__()
            self._pg = pg
            return super().__enter__()
        except BaseException:
            self._teardown()
            raise

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._teardown()

    def _enter(self) -> ShardedRunner:
        if self.checkpoint:
            plan_apply.apply(self.model, self.checkpoint)
        if self.settings.precision == "bf16":  # dtype first: fully_shard shards what it is given
            self._cast_back = [(p, p.data) for p in self.model.parameters()]
            fake_inputs.to_dtype(self.model, torch.bfloat16) if self.fake else self.model.to(torch.bfloat16)
        self.sharded = shard_model(self.model, self._mesh, self.shard, self.units, self.settings.precision)
        super()._enter()
        if self.engine == "zero_optimizer":
            params = [p for p in self.model.parameters() if p.requires_grad]
            foreach = True if self.fake and self.settings.fake_target == "cuda" else None
            self.optimizer = zero_optimizer(params, self.settings.optimizer, foreach) if params else None
        if self.settings.precision == "fp16-mixed" and self.engine == "fully_shard":
            self.scaler = None  # FSDP2 reduces in fp32 (reduce_dtype); no loss scaling is recorded
        return self

    def _teardown(self) -> None:
        """Undo _enter and the process group; safe to call twice and after a partial _enter."""
        if self.sharded is not None:
            self.sharded.restore()
            self.sharded = None
        for p, data in self._cast_back:
            p.data = data
        self._cast_back = []
        if self.checkpoint:
            plan_apply.remove(self.model)
        if self._pg is not None:
            pg, self._pg, self._mesh = self._pg, None, None
            pg.__exit__(None, None, None)
        if self._quiet is not None:
            quiet, self._quiet = self._quiet, None
            quiet.__exit__(None, None, None)

    def measure(self, *args, **kwargs) -> Measurement:
        with fake_fsdp_recording() if self.fake else contextlib.nullcontext():
            return super().measure(*args, **kwargs)

    def _optimizer_step(self):
        # under fake tensors the step's foreach ops run on the local shards (`LocalForeach`): the same
        # ops on the same tensors as DTensor's dispatch, without its sharding propagation
        return LocalForeach() if self.fake and self.engine == "fully_shard" else super()._optimizer_step()

    def _autocast(self):
        if self.engine == "fully_shard":  # MixedPrecisionPolicy casts, not autocast
            return contextlib.nullcontext()
        return super()._autocast()

    def state_bytes(self) -> tuple[int, int, int]:
        """(parameters + buffers, optimizer state, gradients) bytes on this rank: the local shards."""
        m = self.model
        param = unique_bytes(local_tensor(t) for t in (*m.parameters(), *m.buffers()))
        opt = unique_bytes(local_tensor(t) for t in self.optimizer_state())
        grads = unique_bytes(local_tensor(p.grad) for p in m.parameters() if p.grad is not None)
        return param, opt, grads

    def optimizer_state(self) -> list[torch.Tensor]:
        inner = getattr(self.optimizer, "optim", self.optimizer)  # ZeroRedundancyOptimizer: the local one
        return [] if inner is None else [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """FSDP2's advice on a model whose output is a view (an in-place op on it would skip a hook) is about
    the user's later code, not the step recorded, and would be repeated on every step."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module", category=UserWarning)
        yield


class LocalForeach(TorchFunctionMode):
    """While open, a `torch._foreach_*` call on DTensors runs on their local tensors.

    An optimizer's foreach step over FSDP2's sharded parameters is pointwise over lists of DTensors
    that share one mesh and placements (parameters, gradients, state made by zeros_like): DTensor's
    dispatch propagates the placements and runs the same foreach op on the local tensors, whose
    results are what is allocated. That propagation, cold, takes seconds per op over a 7B model's
    291 parameters under fake tensors (issue 14, docs/design.md §3); this mode runs the local op
    directly. Its temporaries come back as plain tensors, which only later foreach calls of the same
    step take. A call whose DTensors differ in mesh or placements, or are not Shard/Replicate, goes
    to DTensor as before. tests/test_sharded_engine.py (`test_fake_optimizer_step_on_local_shards_equals_dtensors`) checks the recorded step equals DTensor's to the byte.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "").startswith("_foreach_"):
            from torch.distributed.tensor import DTensor

            dts = [t for t in tree_leaves((args, kwargs)) if isinstance(t, DTensor)]
            if dts and _pointwise_safe(dts):
                args, kwargs = tree_map_only(DTensor, lambda t: t._local_tensor, (args, kwargs))
        return func(*args, **kwargs)


def _pointwise_safe(dts: list) -> bool:
    """Whether a pointwise op on these DTensors is the same op on their local tensors."""
    first = dts[0]
    return all(p.is_shard() or p.is_replicate() for p in first.placements) and all(
        t.device_mesh == first.device_mesh and t.placements == first.placements for t in dts
    )


# -- what FakeRecorder (measure/fake.py) does not see of FSDP2, until it does -------------------------


@contextlib.contextmanager
def fake_fsdp_recording() -> Iterator[None]:
    """While open, `fake.FakeRecorder` sees the two things of FSDP2 it misses on its own.

    1. DTensor outputs. The optimizer step on sharded parameters runs DTensor ops; the recorder's
       dispatch mode sees their DTensor results, whose own storage is not real. Each is counted by
       its local tensor (what `Recorder` sees on the CPU).
    2. `UntypedStorage.resize_`. FSDP2 allocates a unit's unsharded parameters by resizing their
       storages to full size before the all-gather copies into them, and frees them by resizing to 0
       (fsdp/_fully_shard/_fsdp_common.py `alloc_storage`/`free_storage`). That is no op, so no dispatch
       mode sees it; on the CPU it is an allocation and a free like any other. Each resize of a fake
       storage is reported to the active recorders as the allocator would see it.

    Both belong in measure/fake.py (`fake_storage_key` and `_see` unwrapping `_local_tensor`, and a
    `FakeRecorder.resized(storage, old_nbytes)` called from a resize_ hook); scoped here so the single-
    device path is untouched.
    """
    from ckpt_tune.measure import fake

    orig_key, orig_see, orig_resize = fake.fake_storage_key, fake.FakeRecorder._see, torch.UntypedStorage.resize_

    def key(t: torch.Tensor) -> int:
        return orig_key(local_tensor(t))

    def see(self, t, inputs, size):
        return orig_see(self, local_tensor(t), inputs, size)

    def resize_(st, size):
        out = orig_resize(st, size)
        for rec in list(fake._RECORDERS):
            if rec._active:
                _resized(rec, st)
        return out

    fake.fake_storage_key, fake.FakeRecorder._see, torch.UntypedStorage.resize_ = key, see, resize_
    try:
        yield
    finally:
        fake.fake_storage_key, fake.FakeRecorder._see, torch.UntypedStorage.resize_ = orig_key, orig_see, orig_resize


def _resized(rec, st: torch.UntypedStorage) -> None:
    """Tell FakeRecorder `rec` that storage `st` now holds st.nbytes() bytes."""
    k, raw = st._cdata, st.nbytes()
    if k in rec._live:  # born while recording: its size changes now
        n = rec._rounded(raw)
        if n != rec._live[k]:
            rec._events.append((rec._tick(), n - rec._live[k], k))
        rec._live[k], rec._raw[k] = n, raw
    elif raw > 0:  # older and grown: a block allocated now (its earlier free, like Recorder's, unseen)
        rec._old.pop(k, None)
        rec._alloc(st, k, None)


def measure_sharded(
    model: nn.Module,
    batch_fn: Callable[[int], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batch_size: int,
    *,
    world_size: int,
    shard: str,
    rank: int = 0,
    settings: StepSettings = StepSettings(),
    units: Sequence[str | Sequence[str]] | None = None,
    checkpoint: Sequence = (),
    marked: Sequence[str] = (),
) -> Measurement:
    """Rank `rank`'s recorded steady-state iteration (a fresh runner: warm-up, then the recorded step)."""
    with ShardedRunner(
        model, batch_fn, loss_fn, settings, world_size=world_size, shard=shard, rank=rank, units=units, checkpoint=checkpoint
    ) as r:
        return r.measure(batch_size, units=marked)

