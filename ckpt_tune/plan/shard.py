"""Shard a model as its plan says: FSDP2's `fully_shard` on each shard unit, then on the root.

    model = build()
    ckpt_tune.apply(model, "plan.yaml")    # checkpoint wrappers first
    ckpt_tune.shard(model, "plan.yaml")    # then the sharding the plan was made for
    optimizer = torch.optim.AdamW(model.parameters(), lr=...)

A plan for `world_size` N > 1 records its stage (`shard`) and the modules that get `fully_shard`
(`shard_units`, plan/file.py). The stages are those of docs/design.md §6, and this module
holds their vocabulary once: measure/sharded.py records a step under the same calls.

    zero3, fsdp  fully_shard(unit, reshard_after_forward=True) for every unit, then the root
    zero2        the same with reshard_after_forward=False: parameters stay gathered from forward
                 to backward; gradients and optimizer state are sharded
    zero1        the model as it is; the optimizer is `torch.distributed.optim.ZeroRedundancyOptimizer`
                 (`ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=...)`)

`bf16-mixed` (`fp16-mixed`) is FSDP2's `MixedPrecisionPolicy(param_dtype=bf16 (fp16), reduce_dtype=fp32)`,
not autocast: the plan's figures were recorded that way. A `bf16` (pure) plan expects the model cast
before it is sharded.

The checkpoint wrappers of plan/apply.py replace the instance's `forward`, and FSDP2's hooks live in
`__call__`, so wrapping before or after sharding gives the same step; wrapping first is the order the
patch snippet (plan/patch.py) writes and the one to use.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckpt_tune.errors import PlanError
from ckpt_tune.plan.file import Plan, ShardUnit, load_plan

# shard stage -> (engine, reshard_after_forward)
ENGINES: dict[str, tuple[str, bool | None]] = {
    "zero1": ("zero_optimizer", None),
    "zero2": ("fully_shard", False),
    "zero3": ("fully_shard", True),
    "fsdp": ("fully_shard", True),
}
# mixed precisions: FSDP2 gathers parameters in this dtype and reduces gradients in fp32
MIXED = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
# a process group's backend -> the device type of its mesh, for parameters still on the CPU
_BACKEND_DEVICE = {"nccl": "cuda", "xccl": "xpu"}


def fully_shard_options(shard: str, precision: str, mesh: Any) -> dict[str, Any]:
    """The keyword arguments of `fully_shard` for a fully_shard stage under `precision`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    engine, reshard = ENGINES[shard]
    if engine != "fully_shard":
        raise ValueError(f"{shard} does not call fully_shard")
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard}
    if precision in MIXED:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=MIXED[precision], reduce_dtype=torch.float32)
    return options


def fully_shard_units(
    model: nn.Module, units: Sequence[ShardUnit], mesh: Any, shard: str, precision: str = "fp32"
) -> None:
    """`fully_shard` every unit (a module name, or a tuple of names sharded as one group), in order,
    then the root, with the stage's options. No checks: callers resolve names first."""
    from torch.distributed.fsdp import fully_shard

    options = fully_shard_options(shard, precision, mesh)
    for u in units:
        fully_shard(model.get_submodule(u) if isinstance(u, str) else [model.get_submodule(n) for n in u], **options)
    fully_shard(model, **options)


def shard(model: nn.Module, plan: Plan | str | Path | dict, mesh: Any = None) -> nn.Module:
    """Shard `model` in place as `plan` says, for this rank of the run; returns `model`.

    Call it after `ckpt_tune.apply(model, plan)` and before building the optimizer, in every rank of
    a job whose default process group is initialised (torchrun, `torch.distributed.init_process_group`).

    - world_size 1: nothing to do; the model is returned as it is (a single-device plan, also under DDP).
    - zero2, zero3, fsdp: `fully_shard` on each of `plan.shard_units`, in order, then on the root, with
      `reshard_after_forward` True (zero3, fsdp) or False (zero2), and `MixedPrecisionPolicy` for a
      mixed precision.
    - zero1: the model is left as it is; build the optimizer as
      `torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class=..., lr=...)`.

    `mesh`: a 1-D DeviceMesh of `plan.world_size` ranks; None makes one over the default process group,
    on the device of the model's parameters, or for parameters on the CPU (or meta) the device of the
    group's backend (nccl: cuda; others: cpu). FSDP2 moves CPU parameters to the mesh's device.

    Raises PlanError when no process group is initialised, when its world size (or the mesh's) is not
    the plan's, for unit names the model lacks, and for a model that is already sharded.
    """
    if not isinstance(model, nn.Module):
        raise PlanError(f"shard needs an nn.Module, got {type(model).__name__}")
    plan = load_plan(plan)
    if plan.world_size == 1:
        return model
    import torch.distributed as dist

    where = f"the plan is for {plan.world_size} ranks ({plan.shard})"
    if mesh is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise PlanError(
                f"{where}, but no process group is initialised",
                hint=f"run under `torchrun --nproc-per-node {plan.world_size}` and call "
                "torch.distributed.init_process_group() before ckpt_tune.shard",
            )
        size = dist.get_world_size()
    else:
        if mesh.ndim != 1:
            raise PlanError(f"{where} on a 1-D mesh, got a {mesh.ndim}-D mesh", hint="pass a 1-D DeviceMesh, or mesh=None")
        size = mesh.size()
    if size != plan.world_size:
        raise PlanError(
            f"{where}, but this run has {size}",
            hint=f"run {plan.world_size} ranks, or make a plan for {size} with `ckpt-tune search --world-size {size}`",
        )
    engine, _ = ENGINES[plan.shard]
    if engine != "fully_shard":  # zero1: the optimizer is sharded, not the model
        return model
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        raise PlanError("the model is already sharded (fully_shard was called on it)", hint="shard a model once")
    _check_names(model, plan.shard_units)
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(mesh_device_type(model), (size,))
    fully_shard_units(model, plan.shard_units, mesh, plan.shard, plan.precision)
    return model


def mesh_device_type(model: nn.Module) -> str:
    """The device type of a mesh for `model`: its parameters' device when they are on an accelerator,
    else that of the default process group's backend (nccl: cuda, xccl: xpu, others: cpu)."""
    import torch.distributed as dist

    on = {p.device.type for p in model.parameters()} - {"cpu", "meta"}
    if len(on) == 1:
        return on.pop()
    if on:
        raise PlanError(f"the model's parameters are on several devices ({', '.join(sorted(on))})", hint="pass mesh=")
    backend = str(dist.get_backend())
    return next((d for b, d in _BACKEND_DEVICE.items() if b in backend), "cpu")


def _check_names(model: nn.Module, units: Sequence[ShardUnit]) -> None:
    names = [n for u in units for n in ((u,) if isinstance(u, str) else u)]
    known = [n for n, _ in model.named_modules(remove_duplicate=False) if n]
    found = set(known)
    missing = [n for n in names if n not in found]
    if missing:
        close: list[str] = []
        for name in missing:
            close += [c for c in difflib.get_close_matches(name, known, n=5, cutoff=0.6) if c not in close]
        raise PlanError(
            f"the plan's shard_units name {', '.join(missing[:5])}, which the model lacks",
            hint=(f"close matches: {', '.join(close[:5])}" if close else "no close matches")
            + "; was the plan made for this model? names come from model.named_modules()",
        )
