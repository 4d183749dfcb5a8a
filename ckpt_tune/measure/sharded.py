"""One rank's training iteration under PyTorch's own sharding engines, recorded like any other step
(docs/design.md §6, "The measured sharded step").

A fake process group (`torch.testing._internal.distributed.fake_pg`: collectives return at once and move
no data) lets one CPU process play rank r of N; FSDP2's `fully_shard` or `ZeroRedundancyOptimizer` then
allocate rank r's shards and buffers, and `StepRunner.measure` records them.

    with ShardedRunner(model, batch_fn, loss_fn, StepSettings(), world_size=8, shard="zero3") as r:
        m = r.measure(batch_size, units=blocks)      # rank 0's Measurement

The stages are `ENGINES` of plan/shard.py: zero3/fsdp `fully_shard(unit, reshard_after_forward=True)`
per unit, then the root; zero2 the same with `reshard_after_forward=False`; zero1 the model as it is and
`ZeroRedundancyOptimizer`. `bf16-mixed` under fully_shard is FSDP2's `MixedPrecisionPolicy`, not autocast.

- `fake_process_group(N, rank)`: the default group on the fake backend and a 1-D CPU mesh, destroyed on
  exit; refuses to run where a process group exists.
- `shard_model` shards in place; its `ShardedModel.restore()` puts back the classes, parameters, hooks and
  state fully_shard changed, so the model is trainable on one device afterwards.
- Checkpoint wrappers go on before the engine, as in a user's script; a segment's blocks must share one
  shard unit (its recompute calls their forwards without FSDP's pre-forward all-gather).
- Under fake tensors (`--device meta`) the mesh is made outside fake mode and `fake_fsdp_recording` lets
  the recorder see DTensor outputs and `UntypedStorage.resize_`.
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

from ckpt_tune import vocab
from ckpt_tune.errors import CkptTuneError
from ckpt_tune.measure import fake_inputs
from ckpt_tune.measure.fake_sharded import LocalForeach, fake_fsdp_recording
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

