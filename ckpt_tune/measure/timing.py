"""What a step costs in time: `Timing` (the measured or counted figures of one plan at one batch) and
`iteration_flops`, the FLOPs of one iteration per module, which stand in for time under fake tensors
(docs/design.md §3)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ckpt_tune.measure import quantized
from ckpt_tune.plan.entry import Entry


@dataclass(frozen=True)
class Timing:
    batch_size: int
    checkpoint: tuple[Entry, ...]
    step_ms: float
    forward_ms: dict[str, float]  # module name -> inclusive forward time (ms), fastest of the repeats
    unit: str = "ms"  # "GFLOP" under fake tensors, where FLOPs stand in for time



def iteration_flops(
    model: nn.Module, iteration: Callable[[Callable[[], None]], None]
) -> tuple[dict[str, float], dict[str | None, float]]:
    """GFLOP per module of one forward, and of one whole iteration (forward, backward, optimizer step;
    key None: the iteration's total). `iteration(after_forward)` runs one iteration of `model` and calls
    `after_forward()` once its loss exists. The iteration's per-module figures let the search add back
    the share of blocks it left out of a shortened chain (tune/repeats.py)."""
    from torch.utils.flop_counter import FlopCounterMode

    quantized.register_flops()
    root = type(model).__name__

    def per_module(fc) -> dict:
        out: dict = {}
        for key, ops in fc.get_flop_counts().items():
            if key == root or key.startswith(root + "."):
                out[key[len(root) + 1 :] if key != root else ""] = sum(ops.values()) / 1e9
        return out

    forward: dict = {}
    with FlopCounterMode(display=False) as step:
        # name the model's modules from its root now: a loss that calls submodules without the root's
        # forward (a Lightning training_step calling self.blocks) would otherwise have them named by
        # their own class, and their counts would match no module of the plan
        tracker = getattr(step, "mod_tracker", None)
        if hasattr(tracker, "_get_mod_name"):
            tracker._get_mod_name(model)
        iteration(lambda: forward.update(per_module(step)))
    total = sum(sum(ops.values()) for key, ops in step.get_flop_counts().items() if key == "Global") / 1e9
    return forward, {**per_module(step), None: total}
