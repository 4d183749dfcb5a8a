"""A run of consecutive blocks under one checkpoint: its entry kind and its choice kind. Runtime:
plan/segment.py (over plan/checkpoint.py). The memory model gives runs their own terms (tune/terms.py)."""

from __future__ import annotations

from ckpt_tune.errors import PlanError
from ckpt_tune.plan.kinds.base import Action, Call, EntryKind, Kind


class SegmentEntry(EntryKind):
    action, runtime = Action.SEGMENT, ("checkpoint", "segment")
    comment = "one segment: one checkpoint over these blocks"

    def parse(self, value):
        if not (isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value)):
            return None
        if len(value) < 2:
            raise PlanError(
                f"the plan lists a segment of {len(value)} block(s): {list(value)}",
                hint="a segment is two or more consecutive blocks; write a single block as its name alone",
            )
        return tuple(value), None

    def check(self, modules, policy):
        if len(modules) < 2 or policy is not None:
            raise PlanError(
                f"a segment is two or more consecutive blocks and no policy, got {list(modules)!r}",
                hint="write a single block as its name alone, a module under a policy as {module: NAME, policy: POLICY}",
            )

    def data(self, modules, policy):
        return list(modules)

    def label(self, modules, policy):
        return f"{modules[0]}..{modules[-1]}"

    def state(self, policy):
        return "checkpointed in a segment"

    def call(self, modules, policy):
        return Call("segment", "checkpoint_segment", None, (modules,))

    def state_of(self, module):
        return self.state(None) if self._runtime().SEGMENT_ATTR in module.__dict__ else None

    def undo(self, module):
        mark = module.__dict__.get(self._runtime().SEGMENT_ATTR)
        if mark is not None:
            mark[0].unwrap()  # all its blocks, and its hook on the model


ENTRY = SegmentEntry()


class Segments(Kind):
    name, entry, runs = "segments", ENTRY, True
    help = "runs of blocks under one checkpoint"
