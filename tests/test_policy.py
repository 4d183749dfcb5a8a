"""Op-level policies (ckpt_tune/plan/policy.py): what each keeps, in the plan file and on a model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ckpt_tune.errors import PlanError
from ckpt_tune.plan import policy
from ckpt_tune.plan.entry import POLICIES, Action, Entry
from ckpt_tune.plan.file import Plan, load_plan, write_plan


def test_the_plan_layer_names_the_policies_the_rules_define() -> None:
    assert POLICIES == policy.POLICIES


def test_each_policy_keeps_what_its_documentation_says() -> None:
    aten = torch.ops.aten
    ops = [aten.addmm.default, aten.gelu.default, aten.mm.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default, aten.bmm.default, aten.native_layer_norm.default]
    kept = {p: [op for op in ops if policy.OpRule(p).saves(op)] for p in POLICIES}
    rule = policy.OpRule("half-matmuls")
    assert [rule.saves(op) for op in ops] == [True, False, False, True, True, False]  # every 2nd matmul recomputed
    assert kept["matmuls"] == [aten.addmm.default, aten.mm.default,
                               aten._scaled_dot_product_flash_attention_for_cpu.default, aten.bmm.default]
    assert kept["attention"] == [aten._scaled_dot_product_flash_attention_for_cpu.default]


class _CountMM(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.mm += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("name", "recomputed"), [(None, 1), ("matmuls", 0), ("half-matmuls", 0), ("attention", 1)])
def test_backward_recomputes_only_what_the_policy_does_not_keep(name, recomputed) -> None:
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    extra = {"context_fn": policy.context_fn(name)} if name else {}
    out = torch.utils.checkpoint.checkpoint(lambda a: F.gelu(a @ w), x, use_reentrant=False, **extra)
    with _CountMM() as count:
        out.sum().backward()
    assert count.mm == 2 + recomputed  # two for the gradients of x and w, one per recomputed matmul


def test_plan_file_round_trips_policy_entries(tmp_path) -> None:
    entries = ("blocks.0", {"module": "blocks.1", "policy": "matmuls"}, ["blocks.2", "blocks.3"], "blocks.4@attention")
    plan = Plan(target="examples/gpt.py:build", budget_bytes=100, batch_size=4, grad_accum_steps=1, checkpoint=entries,
                predicted_peak_bytes=90, predicted_recompute_fraction=0.1)
    path = write_plan(plan, tmp_path / "plan.yaml")
    assert "  - {module: blocks.1, policy: matmuls}" in path.read_text()
    back = load_plan(path)
    assert back.checkpoint == plan.checkpoint
    assert [e.action for e in back.checkpoint] == [Action.CHECKPOINT, Action.SELECTIVE, Action.SEGMENT, Action.SELECTIVE]
    assert back.to_dict()["checkpoint"][3] == {"module": "blocks.4", "policy": "attention"}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"module": "blocks.1", "policy": "most"}, "unknown op policy 'most'"),
        ({"module": "blocks.1"}, "has the keys module and policy"),
        ({"module": ["blocks.1", "blocks.2"], "policy": "matmuls"}, "has the keys module and policy"),
    ],
)
def test_bad_policy_entries_are_refused_with_a_hint(value, message) -> None:
    with pytest.raises(PlanError, match=message) as info:
        Entry.of(value)
    assert info.value.hint


def test_a_name_with_an_unknown_suffix_stays_a_name() -> None:
    assert Entry.of("blocks.1@home").modules == ("blocks.1@home",)
    assert Entry.of("blocks.1@matmuls").policy == "matmuls"
