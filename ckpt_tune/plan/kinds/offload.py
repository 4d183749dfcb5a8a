"""Activation offload: what a block saves for backward kept in host memory, nothing recomputed. Its
entry kind and its choice kind. Runtime: plan/offload.py. The step's time grows by the transfers the
compute does not hide, modelled at a stated host-link bandwidth (docs/design.md §4)."""

from __future__ import annotations

from ckpt_tune.errors import PlanError
from ckpt_tune.plan.kinds.base import MARK, Action, Call, EntryKind, Kind

# What FLOPs stand for under fake tensors, where the transfers are priced against them: an H100/H200's
# dense bf16 matmul throughput, FLOP/s (measure/op_costs.py prices memory-bound ops the same way).
DEVICE_FLOPS = 990e12


class OffloadEntry(EntryKind):
    action, runtime = Action.OFFLOAD, ("offload",)
    comment = "saved tensors kept in host memory"
    cost, recomputes = "host transfers (modelled)", False

    def parse(self, value):
        if isinstance(value, str):
            name, at, word = value.rpartition(MARK)
            return ((name,), None) if at and word == self.action.value else None
        if not isinstance(value, dict) or "action" not in value:
            return None
        if set(value) != {"module", "action"} or value["action"] != self.action.value or not isinstance(value["module"], str):
            raise PlanError(
                f"a plan entry with an action is {{module: NAME, action: offload}}, got {value!r}",
                hint="the only action written this way is offload",
            )
        return (value["module"],), None

    def state(self, policy):
        return "offloaded"

    def call(self, modules, policy):
        return Call("offload", "offload", modules[0])

    def state_of(self, module):
        return self.state(None) if self._runtime().is_offloaded(module) else None

    def undo(self, module):
        self._runtime().restore(module)


ENTRY = OffloadEntry()


class Offload(Kind):
    name, entry = "offload", ENTRY
    help = "a block's saved tensors kept in host memory; GPUs and --device meta only"
    option = MARK + Action.OFFLOAD.value

    def offer(self, search, batch_size):
        # what each block saves per sample is what its offload moves (one forward)
        saved = search.refinement("offload", "every block", lambda: search.saved_per_sample(batch_size), None)
        if saved is None:
            return ()
        note = (
            f"offload: a block's transfers to host memory and back are modelled at {search.host_link / 1e9:g} GB/s "
            "(--host-link), the part its forward and backward do not hide added to the step time"
        )
        if note not in search.notes:
            search.notes.append(note)
        return (self.option,)

    def owns(self, option):
        return option == self.option

    def neighbour(self, option):
        return 0  # it makes its output as a stored block does

    def cost(self, pricing, unit, option):
        # the transfers its forward and backward do not hide
        nbytes = pricing.saved.get(unit, 0.0) * pricing.batch_size
        return exposed_transfer(nbytes, pricing.scale * pricing.forward.get(unit, 0.0), pricing.host_link, pricing.unit)

    def refusal(self, device):
        if device == "cpu":
            return "offload keeps saved tensors in host memory instead of the device's; on --device cpu they are the same memory"
        return None


def exposed_transfer(nbytes: float, forward: float, host_link: float, unit: str) -> float:
    """The time offloading a block adds to the step, in the timing's unit (ms, or GFLOP under fake
    tensors): its saved bytes go to host memory while its forward runs and come back while its backward
    (about twice the forward) runs, over a host link of `host_link` bytes/s; what the compute does not
    hide is added. Modelled, not measured (docs/design.md §4)."""
    seconds = nbytes / host_link
    each_way = seconds * 1e3 if unit == "ms" else seconds * DEVICE_FLOPS / 1e9
    return max(max(each_way - forward, 0.0) + max(each_way - 2 * forward, 0.0), 1e-6)
