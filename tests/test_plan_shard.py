"""Shard units are part of the plan (issue 15): the plan file's `world_size`, `shard`, `sharding` and
`shard_units`, `ckpt_tune.shard`, and the patch snippet's sharding after its checkpoint wrappers.

The sharded calls run under the fake process group of measure/sharded.py (one CPU process playing rank
0 of N; collectives move no data), on the small GPT of tests/sharded_worker.py.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.distributed as dist
import yaml
from torch.distributed.fsdp import FSDPModule
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

import ckpt_tune
from ckpt_tune.errors import PlanError
from ckpt_tune.measure import sharded
from ckpt_tune.measure.sharded import fake_process_group
from ckpt_tune.plan import shard as plan_shard
from ckpt_tune.plan.apply import applied_names
from ckpt_tune.plan.file import Plan, load_plan, plan_to_yaml, write_plan
from ckpt_tune.plan.patch import patch_snippet, sharding_snippet
from tests import sharded_worker as w
from tests.test_emit import MISSING, assert_names_the_field, plan_data

SINGLE = Plan(
    target="tests/sharded_worker.py:build",
    device="cpu",
    precision="fp32",
    optimizer="adamw",
    budget_bytes=2**30,
    batch_size=w.BATCH,
    grad_accum_steps=1,
    checkpoint=("blocks.0",),
    predicted_peak_bytes=2**28,
    predicted_recompute_fraction=0.2,
)
SHARDED = dataclasses.replace(SINGLE, world_size=2, shard="zero3", shard_units=w.UNITS, sharding="measured")


# ---------------------------------------------------------------------------------------------------
# The plan file


def test_sharded_plan_file_has_the_keys_after_grad_accum_steps() -> None:
    text = plan_to_yaml(SHARDED)
    data = yaml.safe_load(text)
    keys = list(data)
    assert keys[keys.index("grad_accum_steps") + 1 : keys.index("checkpoint")] == [
        "world_size",
        "shard",
        "sharding",
        "shard_units",
    ]
    assert data["world_size"] == 2
    assert data["shard"] == "zero3"
    assert data["sharding"] == "measured"
    assert data["shard_units"] == ["blocks.0", "blocks.1"]
    assert "# ranks; the budget and the peaks are per rank" in text


def test_single_device_plan_file_is_unchanged() -> None:
    """No sharding keys for one device: the file is the one written before they existed."""
    data = yaml.safe_load(plan_to_yaml(SINGLE))
    assert not {"world_size", "shard", "sharding", "shard_units"} & set(data)
    assert not SINGLE.sharded
    assert SHARDED.sharded


@pytest.mark.parametrize(
    "plan",
    [
        SHARDED,
        dataclasses.replace(SHARDED, shard="zero2", sharding="arithmetic", world_size=64, precision="bf16-mixed"),
        dataclasses.replace(SHARDED, shard="fsdp", shard_units=()),  # the root alone
        dataclasses.replace(SHARDED, shard="zero1", shard_units=()),
        # a unit of several modules, and names YAML would read as other types unless quoted
        dataclasses.replace(SHARDED, shard_units=("0", ("1", "2"), "true", "layers.10")),
        # a segment sharded as one unit
        dataclasses.replace(SHARDED, checkpoint=(("blocks.0", "blocks.1"),), shard_units=(("blocks.0", "blocks.1"),)),
    ],
)
def test_sharded_plans_round_trip(plan: Plan, tmp_path) -> None:
    path = write_plan(plan, tmp_path / "plan.yaml")
    assert load_plan(path) == plan
    assert load_plan(plan) == plan
    assert load_plan(json.loads(json.dumps(plan.to_dict()))) == plan  # to_dict is JSON


def test_units_given_as_lists_are_kept_as_tuples() -> None:
    plan = dataclasses.replace(SHARDED, shard_units=["blocks.0", ["blocks.1", "blocks.2"]])
    assert plan.shard_units == ("blocks.0", ("blocks.1", "blocks.2"))
    assert load_plan({**plan.to_dict(), "shard_units": [["blocks.0"]]}).shard_units == ("blocks.0",)


def test_an_old_plan_file_without_the_keys_is_one_device(tmp_path) -> None:
    old = "\n".join(
        [
            "version: 1",
            "target: examples/gpt.py:build",
            "device: cuda",
            "precision: bf16-mixed",
            "optimizer: adamw",
            "budget_bytes: 25769803776",
            "batch_size: 12",
            "grad_accum_steps: 1",
            "checkpoint:",
            "  - blocks.0",
            "predicted_peak_bytes: 24101123072",
            "predicted_recompute_fraction: 0.11",
        ]
    )
    path = tmp_path / "old.yaml"
    path.write_text(old + "\n")
    plan = load_plan(path)
    assert (plan.world_size, plan.shard, plan.shard_units, plan.sharding) == (1, "none", (), "none")
    explicit = {**yaml.safe_load(old), "world_size": 1, "shard": "none", "sharding": "none", "shard_units": []}
    assert load_plan(explicit) == plan


def _sharded(**changes) -> dict:
    return plan_data(SHARDED, **changes)


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"world_size": 0}, "world_size", "must be >= 1"),
        ({"world_size": "8"}, "world_size", "must be an integer"),
        ({"world_size": True}, "world_size", "must be an integer"),
        ({"world_size": 2.0}, "world_size", "must be an integer"),
        ({"shard": "zero4"}, "shard", "not one of none, zero1, zero2, zero3, fsdp"),
        ({"shard": "none"}, "shard", "is 'none' but world_size is 2"),
        ({"shard": MISSING}, "shard", "is 'none' but world_size is 2"),
        ({"world_size": 1}, "shard", "is 'zero3' but world_size is 1"),
        ({"world_size": 1, "shard": "none"}, "sharding", "is 'measured' but world_size is 1"),
        ({"sharding": "measure"}, "sharding", "not one of none, measured, arithmetic"),
        ({"sharding": "none"}, "sharding", "say how the per-rank figures were obtained"),
        ({"shard_units": "blocks.0"}, "shard_units", "list of module names"),
        ({"shard_units": ["blocks.0", 1]}, "shard_units", "list of module names"),
        ({"shard_units": ["blocks.0", []]}, "shard_units", "list of module names"),
        ({"shard_units": ["blocks.0", ""]}, "shard_units", "root module"),
        ({"shard_units": ["blocks.0", ["blocks.1", "blocks.0"]]}, "shard_units", "'blocks.0' more than once"),
        ({"shard_units": ["blocks", "blocks.0"]}, "shard_units", "lists 'blocks' before 'blocks.0'"),
        ({"shard": "zero1"}, "shard_units", "only zero2, zero3, fsdp call fully_shard"),
        ({"checkpoint": [["blocks.0", "blocks.1"]]}, "shard_units", "of the segment"),
        ({"shard_unit": ["blocks.0"]}, "shard_unit", "not a plan field"),
    ],
)
def test_bad_sharding_keys_name_the_field(changes: dict, field: str, words: str, tmp_path) -> None:
    assert_names_the_field(_sharded(**changes), field, words, tmp_path)


def test_segment_hint_says_how_to_list_it() -> None:
    with pytest.raises(PlanError) as err:
        load_plan(_sharded(checkpoint=[["blocks.0", "blocks.1"]]))
    assert err.value.hint == "list the segment's blocks as one unit: - [blocks.0, blocks.1]"


# ---------------------------------------------------------------------------------------------------
# ckpt_tune.shard


def local_shapes(model: torch.nn.Module) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {
        n: (type(p).__name__, tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape))
        for n, p in model.named_parameters()
    }


def count_calls(model: torch.nn.Module, name: str) -> list[None]:
    calls: list[None] = []
    model.get_submodule(name).register_forward_pre_hook(lambda *_: calls.append(None))
    return calls


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero3_keeps_one_shard_of_every_parameter(world_size: int) -> None:
    full = {n: tuple(p.shape) for n, p in w.build().named_parameters()}
    plan = dataclasses.replace(SHARDED, world_size=world_size)
    with fake_process_group(world_size):
        model = ckpt_tune.shard(ckpt_tune.apply(w.build(), plan), plan)
        assert isinstance(model, FSDPModule)
        assert all(isinstance(model.get_submodule(u), FSDPModule) for u in w.UNITS)
        # rank 0's chunk of dim 0: ceil(n / world_size) rows (torch.chunk, as FSDP2 shards)
        expected = {n: ("DTensor", (math.ceil(s[0] / world_size), *s[1:])) for n, s in full.items()}
        assert local_shapes(model) == expected
        total = sum(math.prod(s) for s in full.values())
        assert total / world_size <= sum(math.prod(s) for _, s in local_shapes(model).values()) < total / world_size * 1.1
        # the checkpoint wrapper went on first and still recomputes under FSDP's hooks
        assert applied_names(model) == ("blocks.0",)
        calls = count_calls(model, "blocks.0.ln_1")
        loss = w.loss_fn(model, w.make_batch(w.BATCH))
        assert isinstance(model.blocks[0].ln_1.weight, DTensor)  # resharded after forward
        loss.backward()
        assert len(calls) == 2  # forward, and the recompute in backward
    assert not dist.is_initialized()


@pytest.mark.parametrize(("shard", "gathered"), [("zero2", True), ("zero3", False), ("fsdp", False)])
def test_zero2_keeps_parameters_gathered_from_forward_to_backward(shard: str, gathered: bool) -> None:
    plan = dataclasses.replace(SHARDED, shard=shard, precision="bf16-mixed")
    with fake_process_group(2):
        model = ckpt_tune.shard(ckpt_tune.apply(w.build(), plan), plan)
        loss = w.loss_fn(model, w.make_batch(w.BATCH))
        params = dict(model.blocks[1].named_parameters())
        if gathered:  # unsharded, full size, cast by the MixedPrecisionPolicy
            assert all(type(p) is torch.nn.Parameter for p in params.values())
            assert {p.dtype for p in params.values()} == {torch.bfloat16}
            full = {n: p.shape for n, p in w.build().blocks[1].named_parameters()}
            assert {n: p.shape for n, p in params.items()} == full
        else:
            assert all(isinstance(p, DTensor) for p in params.values())
        loss.backward()
        assert all(isinstance(p, DTensor) for p in model.blocks[1].parameters())  # sharded again


def test_zero1_and_one_device_plans_leave_the_model_as_it_is() -> None:
    model = w.build()
    assert ckpt_tune.shard(model, SINGLE) is model  # no process group needed
    assert not isinstance(model, FSDPModule)
    zero1 = dataclasses.replace(SHARDED, shard="zero1", shard_units=())
    with fake_process_group(2):
        assert ckpt_tune.shard(model, zero1) is model
        assert not any(isinstance(m, FSDPModule) for m in model.modules())
        assert local_shapes(model) == local_shapes(w.build())


def test_shard_refuses_without_a_process_group() -> None:
    with pytest.raises(PlanError, match=r"for 2 ranks \(zero3\), but no process group is initialised") as err:
        ckpt_tune.shard(w.build(), SHARDED)
    assert "torchrun --nproc-per-node 2" in err.value.hint


def test_shard_refuses_another_world_size() -> None:
    with fake_process_group(4), pytest.raises(PlanError, match="but this run has 4") as err:
        ckpt_tune.shard(w.build(), SHARDED)
    assert "--world-size 4" in err.value.hint


def test_shard_takes_a_mesh_of_the_plan_size() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(4):
        with pytest.raises(PlanError, match="but this run has 4"):
            ckpt_tune.shard(w.build(), SHARDED, mesh=init_device_mesh("cpu", (4,)))
        with pytest.raises(PlanError, match="1-D mesh, got a 2-D mesh"):
            ckpt_tune.shard(w.build(), SHARDED, mesh=init_device_mesh("cpu", (2, 2)))
        model = ckpt_tune.shard(w.build(), dataclasses.replace(SHARDED, world_size=4), mesh=init_device_mesh("cpu", (4,)))
        assert isinstance(model, FSDPModule)


def test_shard_refuses_unknown_units_and_a_second_call() -> None:
    plan = dataclasses.replace(SHARDED, shard_units=("block.0", "blocks.1"))
    with fake_process_group(2):
        with pytest.raises(PlanError, match=r"shard_units name block\.0, which the model lacks") as err:
            ckpt_tune.shard(w.build(), plan)
        assert "close matches: blocks.0" in err.value.hint
        model = ckpt_tune.shard(w.build(), SHARDED)
        with pytest.raises(PlanError, match="already sharded"):
            ckpt_tune.shard(model, SHARDED)


def test_shard_accepts_a_plan_file(tmp_path) -> None:
    path = write_plan(SHARDED, tmp_path / "plan.yaml")
    with fake_process_group(2):
        model = ckpt_tune.shard(ckpt_tune.apply(w.build(), path), str(path))
        assert local_shapes(model)["wte.weight"] == ("DTensor", (126, 64))


def test_the_measured_step_uses_the_same_calls() -> None:
    """measure/sharded.py records under plan/shard.py's engines: the vocabulary lives once."""
    assert sharded.ENGINES is plan_shard.ENGINES
    assert sharded.MIXED is plan_shard.MIXED
    with fake_process_group(2) as mesh:
        a = sharded.shard_model(w.build(), mesh, "zero3", w.UNITS)
        b = ckpt_tune.shard(w.build(), SHARDED)
        assert local_shapes(a.model) == local_shapes(b)
        a.restore()


# ---------------------------------------------------------------------------------------------------
# The patch snippet: checkpoint wrappers, then sharding


def exec_snippet(source: str, model: torch.nn.Module) -> dict:
    namespace = {"model": model}
    exec(compile(source, "<patch snippet>", "exec"), namespace)
    return namespace


def test_one_device_patch_has_no_sharding() -> None:
    source = patch_snippet(SINGLE)
    assert sharding_snippet(SINGLE) == ""
    assert source.endswith("\n\nmodel = apply_checkpointing(model)\n")
    assert "torch.distributed" not in source
    assert "Paste after building `model`, before creating the optimizer and before FSDP / torch.compile." in source


@pytest.mark.parametrize("shard", ["zero2", "zero3", "fsdp", "zero1"])
def test_sharded_patch_needs_only_torch_and_shards_after_checkpointing(shard: str) -> None:
    plan = dataclasses.replace(SHARDED, shard=shard, shard_units=() if shard == "zero1" else SHARDED.shard_units)
    source = patch_snippet(plan)
    compile(source, "<patch snippet>", "exec")
    assert "ckpt_tune" not in "".join(line.split("#")[0] for line in source.splitlines())  # in comments only
    imports = {line.strip() for line in source.splitlines() if line.startswith(("import ", "from "))}
    standard = ("import types", "from contextlib import contextmanager")
    assert all(i.split()[1].split(".")[0] == "torch" or i in standard for i in imports), imports
    assert "# Per rank of 2 (" + shard + "): predicted peak" in source
    checkpointing = source.index("model = apply_checkpointing(model)")
    if shard == "zero1":
        assert "ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW" in source
        assert checkpointing < source.index("def make_optimizer(model")
        assert "fully_shard" not in source
    else:
        assert checkpointing < source.index("model = apply_sharding(model)")
        assert 'SHARD_UNITS = [\n    "blocks.0",\n    "blocks.1",\n]' in source
        assert f'"reshard_after_forward": {shard != "zero2"}' in source


def test_patch_mixed_precision_and_unit_groups() -> None:
    plan = dataclasses.replace(SHARDED, precision="fp16-mixed", shard_units=(("blocks.0", "blocks.1"),))
    source = sharding_snippet(plan)
    assert "MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)" in source
    assert 'SHARD_UNITS = [\n    ["blocks.0", "blocks.1"],\n]' in source
    assert "mp_policy" not in sharding_snippet(SHARDED)
    momentum = sharding_snippet(dataclasses.replace(SHARDED, shard="zero1", shard_units=(), optimizer="sgd-momentum"))
    assert 'optimizer_kwargs.setdefault("momentum", 0.9)' in momentum
    assert "optimizer_class=torch.optim.SGD" in momentum


def test_patch_wraps_before_fully_shard_and_shards_as_shard_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Executed in a fake process group: at every fully_shard call the wrappers are already on, and the
    model ends up as ckpt_tune.apply + ckpt_tune.shard leave it; a training step runs."""
    import torch.distributed.fsdp as fsdp

    model = w.build()
    seen: list[tuple[str, tuple[str, ...]]] = []
    real = fsdp.fully_shard

    def spy(module, **kwargs):
        name = next(n for n, m in model.named_modules() if m is (module[0] if isinstance(module, list) else module))
        seen.append((name, applied_names(model)))
        return real(module, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", spy)
    with fake_process_group(2):
        patched = exec_snippet(patch_snippet(SHARDED), model)["model"]
        assert patched is model
        assert seen == [("blocks.0", ("blocks.0",)), ("blocks.1", ("blocks.0",)), ("", ("blocks.0",))]
        monkeypatch.setattr(fsdp, "fully_shard", real)
        reference = ckpt_tune.shard(ckpt_tune.apply(w.build(), SHARDED), SHARDED)
        assert local_shapes(model) == local_shapes(reference)
        assert applied_names(model) == applied_names(reference) == ("blocks.0",)
        assert type(model.blocks[0]).__name__ == type(reference.blocks[0]).__name__ == "FSDPBlock"
        calls = count_calls(model, "blocks.0.ln_1")
        w.loss_fn(model, w.make_batch(w.BATCH)).backward()
        assert len(calls) == 2
        assert all(isinstance(p.grad, DTensor) for p in model.parameters())


def test_zero1_patch_builds_the_sharded_optimizer() -> None:
    plan = dataclasses.replace(SHARDED, shard="zero1", shard_units=())
    with fake_process_group(2):
        ns = exec_snippet(patch_snippet(plan), w.build())
        model = ns["model"]
        assert applied_names(model) == ("blocks.0",)
        assert not isinstance(model, FSDPModule)
        optimizer = ns["make_optimizer"](model, lr=0.0)
        assert isinstance(optimizer, ZeroRedundancyOptimizer)
        assert type(optimizer.optim) is torch.optim.AdamW
        w.loss_fn(model, w.make_batch(w.BATCH)).backward()
        optimizer.step()


def test_sharded_patch_refuses_the_wrong_world() -> None:
    with pytest.raises(RuntimeError, match="this plan is for 2 ranks"):
        exec_snippet(patch_snippet(SHARDED), w.build())
    with fake_process_group(4), pytest.raises(RuntimeError, match="torchrun --nproc-per-node 2"):
        exec_snippet(patch_snippet(SHARDED), w.build())
