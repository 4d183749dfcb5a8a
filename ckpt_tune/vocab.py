"""The words every layer shares, named once: precisions, devices, sharding strategies, optimizers, the
five parts of a step's memory, and `RunSpec`, how a step is run. An unknown name is a `CkptTuneError`
that lists the known ones.

Nothing here imports torch at module level: the CLI's `--help` and the pure core stay light.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

from ckpt_tune.errors import CkptTuneError

if TYPE_CHECKING:  # pragma: no cover
    import torch

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
DEVICES = ("cpu", "cuda", "meta")  # device kinds a plan or baseline may record


AUTO = "auto"  # a device not chosen yet: cuda when one is available, else cpu (measure/device.py)


def device_kind(device: str) -> str:
    """"cuda:1" -> "cuda": a plan or baseline made on one GPU holds for another of the same kind."""
    return device.split(":", 1)[0]


SHARDS = ("none", "zero1", "zero2", "zero3", "fsdp")
# how a plan's per-rank figures were obtained: one device (none), rank 0 recorded under the real engine
# with a fake process group (measured), or one device's step divided by arithmetic (tune/sharding.py)
SHARDINGS = ("none", "measured", "arithmetic")


def known(kind: str, value: Any, choices: Sequence[str], flag: str | None = None) -> str:
    """`value` if it is one of `choices`, else a CkptTuneError naming `kind` and the closest choice."""
    if isinstance(value, str) and value in choices:
        return value
    close = difflib.get_close_matches(str(value), choices, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(choices)}"
    raise CkptTuneError(f"unknown {flag or kind} {value!r}: {kind} is one of {', '.join(choices)}", hint)


# -- optimizers --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Optimizer:
    """One optimizer the tool can run and price.

    Attributes:
        name: the name users pass (`--optimizer`, the plan file's `optimizer`).
        states_per_param: full-size state tensors kept per trainable parameter (AdamW: exp_avg and
            exp_avg_sq = 2; SGD with momentum: the momentum buffer = 1).
        eight_bit: the bitsandbytes class that keeps the same states in 8 bits, or None.
        build: (params, foreach) -> torch optimizer, lr=0 so the step reads and writes exactly what a
            real step does while p - 0·update == p bit for bit; None for "none".
    """

    name: str
    states_per_param: int
    eight_bit: str | None
    build: Callable[[list, bool | None], torch.optim.Optimizer] | None

    def make(self, params: list, foreach: bool | None = None) -> torch.optim.Optimizer | None:
        return None if self.build is None or not params else self.build(params, foreach)


def _adamw(params, foreach):
    import torch

    return torch.optim.AdamW(params, lr=0.0, foreach=foreach)


def _adam(params, foreach):
    import torch

    return torch.optim.Adam(params, lr=0.0, foreach=foreach)


def _sgd(params, foreach):
    import torch

    return torch.optim.SGD(params, lr=0.0, foreach=foreach)


def _sgd_momentum(params, foreach):
    import torch

    return torch.optim.SGD(params, lr=0.0, momentum=0.9, foreach=foreach)


def _bnb_adamw8bit(params, foreach, paged: bool = False):
    try:
        import bitsandbytes as bnb
    except ImportError as exc:
        from ckpt_tune.errors import CkptTuneError

        raise CkptTuneError(
            "the 8-bit optimizers are bitsandbytes', which is not installed here", "pip install bitsandbytes"
        ) from exc
    # bitsandbytes' defaults: 8-bit blockwise states for tensors of 4096 elements or more, fp32 below
    cls = bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit
    return cls(params, lr=0.0)


_OPTIMIZER_LIST = (
    Optimizer("adamw", 2, "AdamW8bit", _adamw),
    Optimizer("adam", 2, "Adam8bit", _adam),
    Optimizer("adamw-8bit", 2, None, _bnb_adamw8bit),
    # paged: states of 1e5 elements or more in CUDA unified memory, counted on the device (their size
    # while resident, the most they take); on the CPU bitsandbytes falls back to the unpaged optimizer
    Optimizer("paged-adamw-8bit", 2, None, lambda params, foreach: _bnb_adamw8bit(params, foreach, paged=True)),
    Optimizer("sgd", 0, None, _sgd),
    Optimizer("sgd-momentum", 1, "SGD8bit", _sgd_momentum),
    Optimizer("none", 0, None, None),
)
OPTIMIZER_REGISTRY: dict[str, Optimizer] = {o.name: o for o in _OPTIMIZER_LIST}
OPTIMIZERS = tuple(OPTIMIZER_REGISTRY)


def optimizer(name: str) -> Optimizer:
    """The registered optimizer `name`; an unknown name is an error, never a silent fallback."""
    return OPTIMIZER_REGISTRY[known("optimizer", name, OPTIMIZERS)]


# -- how a step is run ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """How a training step is run: the fields a session's `Settings`, a step runner's `StepSettings`,
    a profile, a baseline's `CheckSettings` and a plan's header share, declared and validated here once.

    Attributes:
        device: "cpu", "cuda", "cuda:N" or "meta" (fake tensors: sized, never run); `Settings` also
            takes None or "auto" (cuda when available, else cpu), resolved when the session starts.
        precision: one of PRECISIONS.
        optimizer: one of OPTIMIZERS; its state is part of the step's memory.
        batch_size: the micro-batch; None where it is not fixed (a runner steps at many, a search finds it).
        world_size: ranks of a sharded run; every figure is then rank 0's.
        shard: one of SHARDS; "none" exactly when `world_size` is 1.

    Raises:
        CkptTuneError: a field out of its range, naming the field and what it takes.
    """

    device: str | None = "cpu"
    precision: str = "fp32"
    optimizer: str = "adamw"
    batch_size: int | None = None
    world_size: int = 1
    shard: str = "none"

    unresolved_device: ClassVar[bool] = False  # whether None / "auto" is a device this class holds
    fixed_batch: ClassVar[bool] = False  # whether batch_size must be given (a plan, a profile, a baseline)

    def __post_init__(self) -> None:
        # read as measure/device.py reads a device: case and surrounding blanks aside
        text = self.device.strip().lower() if isinstance(self.device, str) else self.device
        if text in (None, AUTO):
            if not self.unresolved_device:
                raise CkptTuneError(f"{type(self).__name__} needs a device, got {self.device!r}", "resolve it first")
        elif not isinstance(text, str) or device_kind(text) not in DEVICES:
            raise CkptTuneError(f"unknown device {self.device!r}", f"use {AUTO}, cpu, cuda, cuda:N or meta")
        known("precision", self.precision, PRECISIONS)
        known("optimizer", self.optimizer, OPTIMIZERS)
        for name, required in (("batch_size", self.fixed_batch), ("world_size", True)):
            value = getattr(self, name)
            if (value is not None or required) and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise CkptTuneError(f"{name} must be an integer of at least 1, got {value!r}", "e.g. 8")
        known("shard", self.shard, SHARDS)
        if (self.world_size > 1) != (self.shard != "none"):
            raise CkptTuneError(
                f"shard {self.shard!r} at world_size {self.world_size}: a sharded run (world_size > 1) names "
                f"its stage ({', '.join(SHARDS[1:])}), one device has none",
                "e.g. world_size 8 with shard fsdp, or world_size 1 with shard none",
            )


# -- the five parts of a step's memory ----------------------------------------------------------------


class Part(str, Enum):
    """What a live byte is, at any moment of the iteration. Every breakdown sums these five."""

    PARAMS = "params"
    GRADS = "grads"
    OPTIMIZER = "optimizer"
    ACTIVATIONS = "activations"
    OTHER = "other"

    @property
    def label(self) -> str:
        return _PART_LABELS[self]


_PART_LABELS = {
    Part.PARAMS: "weights + buffers",
    Part.GRADS: "gradients",
    Part.OPTIMIZER: "optimizer state",
    Part.ACTIVATIONS: "saved activations",
    Part.OTHER: "batch, logits/loss, temporaries",
}
PARTS = tuple(p.value for p in Part)


@dataclass(frozen=True)
class Parts:
    """A step's memory at one moment, in its five parts (`Part`): every breakdown is one (the profile's
    at its peak, a baseline's, a moment of the iteration). The parts add up to `total` exactly."""

    params: int  # parameters and buffers
    grads: int  # gradients live at that moment
    optimizer: int  # optimizer state
    activations: int  # tensors saved for backward, live at that moment
    other: int  # batch, logits and loss, temporaries, kernel scratch: what no part above owns

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.other

    def items(self) -> tuple[tuple[Part, int], ...]:
        """(part, bytes) in `Part`'s order."""
        return tuple((p, getattr(self, p.value)) for p in Part)
