"""A block checkpointed under an op-level policy (selective checkpointing): its entry kind and its
choice kind. Runtime: plan/policy.py (the policies' rules) over plan/checkpoint.py. The search measures
which policies keep something, and what each recomputes (`search.useful_policies`, tune/step_costs.py)."""

from __future__ import annotations

from ckpt_tune.errors import PlanError
from ckpt_tune.plan.kinds.base import MARK, POLICIES, Action, Call, EntryKind, Kind


class SelectiveEntry(EntryKind):
    action, runtime = Action.SELECTIVE, ("policy", "checkpoint")
    comment = "checkpointed under an op policy"

    def parse(self, value):
        if isinstance(value, str):
            name, at, policy = value.rpartition(MARK)
            return ((name,), policy) if at and policy in POLICIES else None
        if not isinstance(value, dict) or "action" in value:
            return None
        if set(value) != {"module", "policy"} or not all(isinstance(v, str) for v in value.values()):
            raise PlanError(
                f"a plan entry with an op policy has the keys module and policy, got {value!r}",
                hint="e.g. {module: blocks.3, policy: matmuls}",
            )
        return (value["module"],), value["policy"]

    def check(self, modules, policy):
        if policy not in POLICIES:
            raise PlanError(
                f"unknown op policy {policy!r} for {modules[0]}", hint=f"a policy is one of {', '.join(POLICIES)}"
            )
        if len(modules) != 1:
            raise PlanError(
                f"an op policy applies to one module, got a segment {list(modules)!r}",
                hint="write the entry as {module: NAME, policy: POLICY}",
            )

    def data(self, modules, policy):
        return {"module": modules[0], "policy": policy}

    def label(self, modules, policy):
        return f"{modules[0]}{MARK}{policy}"

    def state(self, policy):
        return f"checkpointed under policy {policy}"

    def call(self, modules, policy):
        return Call("checkpoint", "checkpoint_module", modules[0], keywords=(("policy", policy),))

    def state_of(self, module):
        rt = self._runtime()
        policy = module.__dict__.get(rt.POLICY_ATTR)
        return self.state(policy) if rt.is_checkpointed(module) and policy is not None else None

    def undo(self, module):
        self._runtime().uncheckpoint_module(module)


ENTRY = SelectiveEntry()


class Ops(Kind):
    name, entry = "ops", ENTRY
    timed = True
    help = "op-level policies of a block: keep matmul outputs, recompute the rest"

    def offer(self, search, batch_size):
        policies = search.refinement("op policies", "every block", lambda: search.useful_policies(batch_size), [])
        return tuple(MARK + p for p in policies)

    def owns(self, option):
        return policy_of(option) is not None

    def cost(self, pricing, unit, option):
        return pricing.recompute([unit], pricing.shares[(unit, policy_of(option))])


def policy_of(option: str) -> str | None:
    """The op policy a block's option stands for (`@matmuls`), or None."""
    return option[len(MARK):] if option.startswith(MARK) and option[len(MARK):] in POLICIES else None
