"""Per-GPU memory of one training iteration under sharding, 8-bit optimizers, LoRA and activation offload.

Pure arithmetic on *moments*: what is live (parameters, gradients, optimizer state, saved activations,
everything else) at the largest point of each phase of the iteration (start, forward, backward,
optimizer step). A remedy changes some parts of some phases; the predicted peak is the largest moment
after the change. Taking every phase, not only the measured peak, matters: cutting optimizer state
moves the peak from the optimizer step to the end of forward, and the forward moment has its own mix.

docs/design.md §6, data parallelism over N GPUs (each GPU runs the full micro-batch):

    stage      divided by N                        also on each GPU
    zero1      optimizer state                     -
    zero2      optimizer state, gradients          -
    zero3/fsdp optimizer state, gradients, params  one unit's full parameters while it runs (all-gather)

8-bit optimizers follow bitsandbytes' layout (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"): one byte per state value, one fp32 absmax per block of 256 values, and 32-bit state for
tensors under 4096 values. Nothing here touches a device or a model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from ckpt_tune import vocab
from ckpt_tune.errors import CkptTuneError
from ckpt_tune.tune.memory_model import Terms
from ckpt_tune.vocab import SHARDS, Parts

# which static parts each stage divides by the world size
DIVIDES: dict[str, frozenset[str]] = {
    "none": frozenset(),
    "zero1": frozenset({"optimizer"}),
    "zero2": frozenset({"optimizer", "grads"}),
    "zero3": frozenset({"optimizer", "grads", "params"}),
    "fsdp": frozenset({"optimizer", "grads", "params"}),
}
PHASES = ("start", "forward", "backward", "step")

# bitsandbytes: Optimizer2State/Optimizer1State.init_state (min_8bit_size=4096, block-wise absmax per 256)
MIN_8BIT_SIZE = 4096
QUANT_BLOCK = 256
ABSMAX_BYTES = 4


@dataclass(frozen=True)
class Moment(Parts):
    """What is live at one moment of the iteration (its five parts), and where."""

    phase: str  # one of PHASES: which part of the iteration this moment is the largest of
    where: str  # e.g. "backward: blocks.3", as profiler.peak_phase names it
    ms: float  # since the iteration started
    # saved bytes live at this moment by the module that saved them, largest first; "" is outside every module
    modules: tuple[tuple[str, int], ...] = ()


def peak_of(moments: Iterable[Moment]) -> Moment:
    """The largest moment (the first of equals)."""
    best: Moment | None = None
    for m in moments:
        if best is None or m.total > best.total:
            best = m
    if best is None:
        raise ValueError("no moments")
    return best


def _ceil_div(a: int, n: int) -> int:
    return -(-a // n)


def check_shard(world_size: int | None, shard: str | None) -> tuple[int, str]:
    """Validate `--world-size` / `--shard` together; returns (world_size, shard) with defaults filled in."""
    if shard is not None and shard not in SHARDS:
        raise CkptTuneError(f"unknown --shard {shard!r}", f"use one of {', '.join(SHARDS)}")
    if world_size is not None and world_size < 1:
        raise CkptTuneError(f"--world-size must be at least 1, got {world_size}", "e.g. --world-size 8")
    n = world_size or 1
    if n > 1 and shard in (None, "none"):
        raise CkptTuneError(
            f"--world-size {n} without a sharding stage: plain data parallelism keeps a full copy per GPU",
            "add --shard zero1|zero2|zero3|fsdp (or drop --world-size for the single-GPU numbers)",
        )
    if n == 1 and shard not in (None, "none"):
        raise CkptTuneError(f"--shard {shard} needs --world-size N with N > 1", "e.g. --world-size 8 --shard fsdp")
    return n, shard or "none"


@dataclass(frozen=True)
class StaticBytes:
    """Weights, gradients and optimizer state on one GPU, and the all-gathered working set."""

    params: int
    grads: int
    optimizer: int
    gathered: int = 0  # ZeRO-3/FSDP: one unit's full parameters while it runs

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.gathered


def static_per_gpu(
    param_bytes: int,
    grad_bytes: int,
    optimizer_bytes: int,
    world_size: int = 1,
    shard: str = "none",
    gathered_bytes: int = 0,
) -> StaticBytes:
    """Per-GPU bytes of the states for a (world_size, shard) pair. Shards round up (the last rank pads)."""
    n, shard = check_shard(world_size, shard)
    div = DIVIDES[shard]
    return StaticBytes(
        params=_ceil_div(param_bytes, n) if "params" in div else param_bytes,
        grads=_ceil_div(grad_bytes, n) if "grads" in div else grad_bytes,
        optimizer=_ceil_div(optimizer_bytes, n) if "optimizer" in div else optimizer_bytes,
        gathered=gathered_bytes if "params" in div and n > 1 else 0,
    )


def shard_moment(m: Moment, world_size: int, shard: str, gathered_bytes: int = 0) -> Moment:
    """The moment on one of `world_size` GPUs. The gathered unit is live in forward and backward only:
    the optimizer step works on shards, and the iteration starts before any all-gather."""
    n, shard = check_shard(world_size, shard)
    if n == 1:
        return m
    div = DIVIDES[shard]
    params = _ceil_div(m.params, n) if "params" in div else m.params
    if "params" in div and m.phase in ("forward", "backward"):
        params += gathered_bytes
    return replace(
        m,
        params=params,
        grads=_ceil_div(m.grads, n) if "grads" in div else m.grads,
        optimizer=_ceil_div(m.optimizer, n) if "optimizer" in div else m.optimizer,
    )


def per_gpu_terms(
    terms: Terms, param_bytes: int, optimizer_bytes: int, world_size: int, shard: str, gathered_bytes: int = 0
) -> Terms:
    """Memory-model terms for one GPU of a sharded run: `Terms.static` (params + buffers + optimizer
    state) becomes its per-GPU share plus the gathered unit. Gradients live inside the block terms and
    are left whole: conservative for zero2/zero3, exact for zero1."""
    s = static_per_gpu(param_bytes, 0, optimizer_bytes, world_size, shard, gathered_bytes)
    extra = terms.static - param_bytes - optimizer_bytes  # anything static the two counts leave out
    return replace(terms, static=s.params + s.optimizer + s.gathered + max(extra, 0), measured={})


def accumulate_moment(m: Moment, grad_bytes: int, in_flight: int = 0) -> Moment:
    """The moment in the 2nd..k-th micro-step of gradient accumulation: the summed gradients of the
    earlier micro-steps are live through forward and backward. In backward each new gradient is made,
    then added in place and freed: `in_flight` (one autograd node's parameter gradients, e.g. a Linear's
    weight and bias) is live on top of the sum."""
    if m.phase == "forward":
        return replace(m, grads=max(grad_bytes, m.grads))
    if m.phase == "backward":
        return replace(m, grads=max(grad_bytes, m.grads) + in_flight)
    return m


# -- 8-bit optimizers ----------------------------------------------------------------------------


def eight_bit_state_bytes(numels: Sequence[int], optimizer: str) -> int:
    """Optimizer state bytes of bitsandbytes' 8-bit version of `optimizer` for trainable tensors of these
    sizes: per tensor of n values, `states × (n + 4·ceil(n/256))` bytes, or `states × 4n` below 4096
    values; plus the shared 256-entry fp32 quantization map of each state."""
    k = vocab.optimizer(optimizer).states_per_param
    if k == 0:
        return 0
    total = 0
    quantized = False
    for n in numels:
        if n < MIN_8BIT_SIZE:
            total += k * 4 * n
        else:
            total += k * (n + ABSMAX_BYTES * _ceil_div(n, QUANT_BLOCK))
            quantized = True
    return total + (k * 256 * 4 if quantized else 0)


def eight_bit_moment(m: Moment, new_optimizer_bytes: int) -> Moment:
    """Optimizer state is live all iteration, so every moment loses the same bytes. The step's scratch
    is kept as measured (torch's AdamW step; bitsandbytes' fused 8-bit step needs no more)."""
    return replace(m, optimizer=new_optimizer_bytes)


# -- LoRA ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraPlan:
    """Low-rank adapters on some weight layers, everything else frozen (Hu et al. 2021, "LoRA")."""

    rank: int
    adapted: tuple[str, ...]  # modules that get an adapter (their input stays saved, for the adapter)
    frozen_saves: tuple[str, ...]  # frozen, unadapted weight layers: their input was saved only for the weight's gradient
    adapter_param_bytes: int  # r·(in + out) per adapted layer, in the layer's dtype
    # per adapted layer: (name, bytes of the rank-r intermediate lora_b saves, whether the profile
    # attributes the layer's input to the layer itself; one saved first by an earlier module is not)
    adapter_saves: tuple[tuple[str, int, bool], ...]
    # the largest adapted layer's input: in backward its gradient arrives from two branches (base and
    # adapter), one more input-sized tensor than before
    branch_grad_bytes: int
    trainable_param_bytes: int  # trainable parameter bytes before the change
    optimizer_bytes: int  # optimizer state before the change


def lora_moment(m: Moment, plan: LoraPlan) -> Moment:
    """Frozen base: only adapter parameters have gradients and optimizer state. Saved activations stay,
    except the inputs of frozen unadapted layers; the adapters add their rank-r intermediates, and in
    backward one more input-sized gradient (two branches meet at each adapted layer's input). The
    optimizer step's scratch scales with the trainable bytes."""
    share = plan.adapter_param_bytes / plan.trainable_param_bytes if plan.trainable_param_bytes else 1.0
    live = dict(m.modules)
    dropped = sum(live.get(name, 0) for name in plan.frozen_saves)
    # an adapter's intermediate is live while its layer's input is; where the input is attributed to an
    # earlier module that cannot be told, and it is counted (the safe side)
    added = sum(b for name, b, owns in plan.adapter_saves if live.get(name, 0) > 0 or not owns)
    if m.phase in ("start", "step"):
        added, dropped = 0, 0
    grads = {"forward": 0, "backward": min(m.grads, plan.adapter_param_bytes)}.get(m.phase, plan.adapter_param_bytes)
    other = round(m.other * share) if m.phase == "step" else m.other
    if m.phase == "backward":
        other += plan.branch_grad_bytes
    modules = tuple((n, b) for n, b in m.modules if n not in plan.frozen_saves)
    return replace(
        m,
        params=m.params + plan.adapter_param_bytes,
        grads=grads,
        optimizer=round(plan.optimizer_bytes * share),
        activations=max(0, m.activations - dropped + added),
        other=other,
        modules=modules,
    )


# -- activation offload -------------------------------------------------------------------------


def offload_moment(m: Moment, working_set: int) -> Moment:
    """Saved activations go to host memory as they are made and come back one block at a time: the GPU
    keeps at most one block's saved bytes (`working_set`) of what was live."""
    return replace(m, activations=min(m.activations, working_set))


# -- moments from a profile record alone --------------------------------------------------------


def moments_from_profile(prof) -> tuple[Moment, ...]:
    """Moments from a `profiler.StepProfile` when no recorded run is at hand: the peak from its
    breakdown, and each other phase's largest point of the timeline. Outside the peak the split is not
    known; the rest goes to `other` (so offload does not count it) and backward gradients to 0 (so
    sharding does not divide them): both on the safe side."""
    b = prof.breakdown
    phase = _phase_of(prof.peak_phase)
    out = [Moment(**vars(b), phase=phase, where=prof.peak_phase, ms=0.0)]
    static = prof.param_bytes + prof.optimizer_bytes
    out.append(Moment(prof.param_bytes, prof.grad_bytes, prof.optimizer_bytes, 0, 0, "start", "start of the iteration", 0.0))
    ph = prof.phases or {}
    windows = (("forward", ph.get("iter"), ph.get("loss")), ("backward", ph.get("loss"), ph.get("backward")), ("step", ph.get("backward"), None))
    for name, t0, t1 in windows:
        if name == phase or t0 is None:
            continue
        pts = [(t, v) for t, v in prof.timeline if t >= t0 and (t1 is None or t < t1)]
        if not pts:
            continue
        t, v = max(pts, key=lambda p: p[1])
        grads = prof.grad_bytes if name == "step" else 0
        out.append(Moment(prof.param_bytes, grads, prof.optimizer_bytes, 0, max(0, v - static - grads), name, name, t))
    return tuple(out)


def _phase_of(where: str) -> str:
    if where.startswith("backward"):
        return "backward"
    if where.startswith("optimizer"):
        return "step"
    if where.startswith("start"):
        return "start"
    return "forward"
