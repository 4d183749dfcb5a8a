"""The kinds of plan choice as registered units (plan/kinds/: one module per kind)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt_tune.errors import CkptTuneError, PlanError
from ckpt_tune.plan.apply import applied_names, apply, remove
from ckpt_tune.plan.entry import Entry
from ckpt_tune.plan.kinds import (
    ENTRY_KINDS,
    KINDS,
    RECOMPUTE,
    Action,
    candidates_help,
    kind_of,
    parse_candidates,
)
from ckpt_tune.tune.memory_model import plan_entries

PACKAGE = Path(__file__).resolve().parents[1] / "ckpt_tune"

# one of each kind of entry, in each data form it has, with its label
FORMS = [
    (Action.CHECKPOINT, ["blocks.0"], "blocks.0"),
    (Action.SEGMENT, [["blocks.1", "blocks.2"], ("blocks.1", "blocks.2")], "blocks.1..blocks.2"),
    (Action.SELECTIVE, [{"module": "blocks.3", "policy": "matmuls"}, "blocks.3@matmuls"], "blocks.3@matmuls"),
    (Action.OFFLOAD, [{"module": "blocks.4", "action": "offload"}, "blocks.4@offload"], "blocks.4@offload"),
]


def test_every_action_is_one_registered_kind() -> None:
    assert set(ENTRY_KINDS) == set(Action)
    assert {a for a, _, _ in FORMS} == set(Action)


@pytest.mark.parametrize(("action", "forms", "label"), FORMS)
def test_each_data_form_reads_as_its_kind_and_writes_back(action: Action, forms: list, label: str) -> None:
    for form in forms:
        entry = Entry.of(form)
        assert entry.action is action
        assert entry.label == label
        assert Entry.of(entry.to_data()) == entry
        assert entry.kind is ENTRY_KINDS[action]


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(5))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_a_call_applies_its_entry_and_the_kind_recognises_and_undoes_it() -> None:
    model = Chain()
    entries = [Entry.of(forms[0]) for _, forms, _ in FORMS]
    apply(model, entries)
    assert applied_names(model) == tuple(f"blocks.{i}" for i in range(5))
    for entry in entries:
        for name in entry.modules:
            states = [k.state_of(model.get_submodule(name)) for k in ENTRY_KINDS.values()]
            assert [s for s in states if s is not None] == [entry.kind.state(entry.policy)]
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    remove(model)
    assert applied_names(model) == ()


def test_a_module_wrapped_as_one_kind_is_not_wrapped_as_another() -> None:
    model = apply(Chain(), ["blocks.0"])
    with pytest.raises(PlanError, match=r"blocks\.0 is already checkpointed whole, so it cannot be offloaded too"):
        apply(model, ["blocks.0@offload"])
    apply(model, ["blocks.0"])  # the same entry again: nothing to do


def test_a_kind_is_one_module_with_its_entry_and_its_choices() -> None:
    """Each module of plan/kinds/ (but the base and the registry) holds one entry kind and the choice
    kinds that make its entries; each entry kind has a runtime module of ckpt_tune.plan."""
    modules = {p.stem for p in (PACKAGE / "plan" / "kinds").glob("*.py")} - {"__init__", "base"}
    entry_home = {type(e).__module__.rpartition(".")[2]: e for e in ENTRY_KINDS.values()}
    assert set(entry_home) == modules
    for kind in KINDS.values():
        assert type(kind).__module__ == type(kind.entry).__module__, kind.name
    for entry in ENTRY_KINDS.values():
        assert all((PACKAGE / "plan" / f"{name}.py").is_file() for name in entry.runtime), entry.action


def test_every_option_of_the_search_has_exactly_one_kind() -> None:
    options = ("none", "block", "attn", "attn+mlp", "@matmuls", "@half-matmuls", "@attention", "@offload", "block")
    for option in options[2:]:
        assert sum(k.owns(option) for k in KINDS.values()) == 1, option
    assert kind_of(options, 0) is None
    assert kind_of(options, 1) is KINDS["blocks"]
    # a sub-module named `block` (EfficientNet's MBConv) is a finer option, not the whole block
    assert kind_of(options, 8) is KINDS["submodules"]
    assert plan_entries(("features.2.0",), ("none", "block", "block"), (2,)) == (Entry(("features.2.0.block",)),)
    units = ("blocks.0", "blocks.1")
    # option 1: the whole block; option 4 here: the block under the op policy half-matmuls
    assert plan_entries(units, ("none", "block", "attn", "attn+mlp", "@half-matmuls"), (1, 4)) == (
        Entry(("blocks.0",)),
        Entry.selective("blocks.1", "half-matmuls"),
    )
    assert plan_entries(units, ("none", "block", "attn+mlp", "@offload"), (2, 3)) == (
        Entry(("blocks.0.attn",)),
        Entry(("blocks.0.mlp",)),
        Entry.offload("blocks.1"),
    )


def test_candidates_are_read_and_described_from_the_kinds() -> None:
    assert parse_candidates("all") == RECOMPUTE
    assert parse_candidates("all,offload") == frozenset(KINDS)
    assert parse_candidates(" blocks , ops ") == {"blocks", "ops"}
    with pytest.raises(CkptTuneError, match="did you mean 'segments'"):
        parse_candidates("segment")
    text = candidates_help()
    assert all(f"{k.name} ({k.help})" in text for k in KINDS.values())
    assert [k.name for k in KINDS.values() if k.refusal("cpu")] == ["offload"]  # host and device are one memory
    assert not any(k.refusal("meta") or k.refusal("cuda") for k in KINDS.values())


def test_no_module_outside_the_kinds_branches_on_a_kind() -> None:
    """Search, diagnosis, the CLI and the plan's other modules look kinds up: none tests an entry's
    action or a --candidates word (plan/entry.py builds entries of each action)."""
    allowed = {"plan/entry.py", *(f"plan/kinds/{p.name}" for p in (PACKAGE / "plan" / "kinds").glob("*.py"))}
    words = "|".join(KINDS)
    pattern = re.compile(rf"Action\.[A-Z]+|[\"']({words})[\"'] (not )?in\b|== [\"']({words})[\"']")
    found = [
        f"{path.relative_to(PACKAGE)}: {m.group(0)}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(PACKAGE)) not in allowed
        for m in pattern.finditer(path.read_text())
    ]
    assert not found, found
