"""The patch snippet: Python source a user pastes after building the model, torch only.

It applies the plan's entries exactly as `ckpt_tune.apply` does (plan/apply.py): it embeds, as they
are, the runtime modules of the plan's kinds (plan/kinds/: plan/checkpoint.py, plan/segment.py,
plan/offload.py, plan/policy.py) and makes each entry's call, so `applied_names` and `remove` recognise
modules wrapped by either. A plan for several ranks then shards the model as `ckpt_tune.shard` does
(plan/shard.py), with torch's public API: `fully_shard` on each shard unit and the root, or for zero1 a
`ZeroRedundancyOptimizer` to build the optimizer with. Checkpoint wrappers first, sharding second.
"""

from __future__ import annotations

import ast
import inspect
import json

from ckpt_tune.plan.file import Plan
from ckpt_tune.plan.finetune import peft_code
from ckpt_tune.plan.kinds import ENTRY_KINDS, runtime_module
from ckpt_tune.plan.shard import ENGINES, MIXED
from ckpt_tune.units import format_bytes

_SNIPPET_APPLY = """

def {function}(model):
    for m in model.modules():  # Hugging Face: the recompute would fill the KV cache twice
        if getattr(getattr(m, "config", None), "use_cache", None) is True:
            m.config.use_cache = False
{calls}    return model
"""

# Hugging Face form: transformers' own per-layer switch (GradientCheckpointingLayer.gradient_checkpointing,
# transformers >= 4.52), falling back to the plain wrapper when a planned module is not such a layer.
_SNIPPET_HF = """

CKPT_MODULES = {names}


def apply_checkpointing(model):
    layers = {name: model.get_submodule(name) for name in CKPT_MODULES}
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers < 4.52: no per-layer switch
        return _apply_plain(model)
    norm = torch.nn.modules.batchnorm._NormBase
    if not all(
        isinstance(m, GradientCheckpointingLayer) and not any(isinstance(s, norm) for s in m.modules())
        for m in layers.values()
    ):
        return _apply_plain(model)
    # transformers 5 renamed gradient_checkpointing_enable (now a deprecated alias) to this
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})  # every layer on, non-reentrant (preserves the RNG state)
    model.config.use_cache = False
    for name, m in model.named_modules():  # then only the planned layers stay on
        if isinstance(m, GradientCheckpointingLayer):
            m.gradient_checkpointing = name in layers
    return model
"""


# Sharding, after the checkpoint wrappers: the calls of ckpt_tune.shard (plan/shard.py), torch alone.
_SNIPPET_FULLY_SHARD = """

# Sharding, after the checkpoint wrappers: {title}.
# Run every rank under torchrun (the default process group must exist); then build the optimizer.
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

WORLD_SIZE = {world_size}
# fully_shard each, in this order (a list: modules sharded together as one unit), then the root
SHARD_UNITS = {units}


def apply_sharding(model):
    if not dist.is_initialized() or dist.get_world_size() != WORLD_SIZE:
        raise RuntimeError(f"this plan is for {WORLD_SIZE} ranks: run it under torchrun --nproc-per-node {WORLD_SIZE}")
    # the parameters' device, or for parameters on the CPU the process group's (FSDP moves them there)
    device = next((p.device.type for p in model.parameters() if p.device.type not in ("cpu", "meta")), None)
    backend = str(dist.get_backend())
    device = device or ("cuda" if "nccl" in backend else "xpu" if "xccl" in backend else "cpu")
    mesh = init_device_mesh(device, (WORLD_SIZE,))
    options = {"mesh": mesh, "reshard_after_forward": {reshard}{mp_policy}}
    for unit in SHARD_UNITS:
        fully_shard(model.get_submodule(unit) if isinstance(unit, str) else [model.get_submodule(n) for n in unit], **options)
    fully_shard(model, **options)
    return model


model = apply_sharding(model)
"""

_SNIPPET_ZERO1 = """

# Sharding, after the checkpoint wrappers: ZeRO-1 over {world_size} ranks. The model stays whole on every
# rank and the optimizer state is sharded: build the optimizer as `optimizer = make_optimizer(model, lr=...)`.
# Run every rank under torchrun (the default process group must exist).
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

WORLD_SIZE = {world_size}


def make_optimizer(model, **optimizer_kwargs):
    if not dist.is_initialized() or dist.get_world_size() != WORLD_SIZE:
        raise RuntimeError(f"this plan is for {WORLD_SIZE} ranks: run it under torchrun --nproc-per-node {WORLD_SIZE}")
{defaults}    params = [p for p in model.parameters() if p.requires_grad]
    return ZeroRedundancyOptimizer(params, optimizer_class={optimizer_class}, **optimizer_kwargs)
"""

# the plan's optimizer as torch's class (sgd-momentum: SGD with a momentum buffer, which the plan counts)
_OPTIMIZER_CLASS = {
    "adamw": "torch.optim.AdamW",
    "adam": "torch.optim.Adam",
    "sgd": "torch.optim.SGD",
    "sgd-momentum": "torch.optim.SGD",
}
_STAGE_TITLE = {
    "zero2": "ZeRO-2 as FSDP2 over {n} ranks, reshard_after_forward=False (gradients and\n"
    "# optimizer state sharded; each unit's parameters stay gathered from its forward to its backward)",
    "zero3": "ZeRO-3 as FSDP2 over {n} ranks (parameters, gradients and optimizer\n"
    "# state sharded; each unit's parameters gathered for its forward and again for its backward)",
    "fsdp": "FSDP2 over {n} ranks (parameters, gradients and optimizer state\n"
    "# sharded; each unit's parameters gathered for its forward and again for its backward)",
}


def sharding_snippet(plan: Plan) -> str:
    """The code that shards the model after the checkpoint wrappers, for a plan of world_size > 1
    ("" for one device): the calls of ckpt_tune.shard (plan/shard.py) with torch's public API."""
    if plan.world_size == 1:
        return ""
    if ENGINES[plan.shard][0] != "fully_shard":  # zero1: the optimizer, not the model
        cls = _OPTIMIZER_CLASS.get(plan.optimizer)
        if cls is None:
            return f"\n\n# ZeRO-1 over {plan.world_size} ranks shards optimizer state; this plan has no optimizer.\n"
        momentum = '    optimizer_kwargs.setdefault("momentum", 0.9)  # the plan counts a momentum buffer\n'
        return (
            _SNIPPET_ZERO1.replace("{world_size}", str(plan.world_size))
            .replace("{optimizer_class}", cls)
            .replace("{defaults}", momentum if plan.optimizer == "sgd-momentum" else "")
        )

    def literal(u) -> str:  # json.dumps writes a valid Python string literal for any name
        return json.dumps(u) if isinstance(u, str) else "[" + ", ".join(json.dumps(n) for n in u) + "]"

    units = "[" + "".join(f"\n    {literal(u)}," for u in plan.shard_units) + ("\n]" if plan.shard_units else "]")
    mp = ""
    if plan.precision in MIXED:  # FSDP2's policy, not autocast: the way the plan's step was recorded
        dtype = str(MIXED[plan.precision]).removeprefix("torch.")
        mp = f', "mp_policy": MixedPrecisionPolicy(param_dtype=torch.{dtype}, reduce_dtype=torch.float32)'
    return (
        _SNIPPET_FULLY_SHARD.replace("{title}", _STAGE_TITLE[plan.shard].format(n=plan.world_size))
        .replace("{world_size}", str(plan.world_size))
        .replace("{units}", units)
        .replace("{reshard}", str(ENGINES[plan.shard][1]))
        .replace("{mp_policy}", mp)
    )


def patch_snippet(plan: Plan, *, hf: bool = False, embed: bool = True) -> str:
    """Python source to paste into a training script after the model is built: it checkpoints the
    plan's modules exactly as `ckpt_tune.apply` does, with torch only (no ckpt_tune import), and for a
    plan of several ranks then shards the model as `ckpt_tune.shard` does (`sharding_snippet`).

    `hf=True` uses Hugging Face's per-layer switch when every planned module is a
    GradientCheckpointingLayer, and the plain wrapper otherwise. `embed=False`: each embedded runtime
    module as one comment line (what a terminal shows; the snippet to paste embeds them).
    """
    per_step = plan.batch_size * plan.grad_accum_steps
    costs = list(dict.fromkeys(["recompute", *(e.kind.cost for e in plan.checkpoint)]))
    budget = "" if plan.budget_bytes is None else f" of a {format_bytes(plan.budget_bytes)} budget"
    verified = (
        "not verified by running it"
        if plan.verified_peak_bytes is None
        else f"verified by running it: {format_bytes(plan.verified_peak_bytes)}"
    )
    peak = f"Predicted peak {format_bytes(plan.predicted_peak_bytes)}{budget} ({verified})."
    paste = "before creating the optimizer and before FSDP / torch.compile."
    if plan.world_size > 1:
        peak = f"Per rank of {plan.world_size} ({plan.shard}): p{peak[1:]}"
        paste = "before creating the optimizer and torch.compile: it checkpoints, then shards."
    header = [
        f"# ckpt-tune plan for {plan.target} ({plan.device}, {plan.precision}, optimizer {plan.optimizer})",
        f"# Use micro-batch size {plan.batch_size} with {plan.grad_accum_steps} gradient-accumulation step(s)"
        f" ({per_step} samples per optimizer step).",
        f"# {peak}",
        f"# {' and '.join(costs).capitalize()} add{'s' * (len(costs) == 1)} about "
        f"{plan.predicted_recompute_fraction:.1%} to the step time.",
        f"# Paste after building `model`, {paste}",
    ]
    if plan.peft is not None:  # the model the plan was measured on: the names below are the peft model's
        header += [
            f"# The plan was measured with {plan.peft.method} ({plan.peft.describe()}); build `model` this way:",
            *(f"#   {code_line}".rstrip() for code_line in peft_code(plan.peft).splitlines()),
        ]
    # Hugging Face's per-layer switch checkpoints one layer whole: nothing of another kind
    hf = hf and all(e.kind.whole for e in plan.checkpoint)
    names = "[" + "".join(f"\n    {json.dumps(e.to_data())}," for e in plan.checkpoint) + ("\n]" if plan.checkpoint else "]")
    calls = "".join(f"    {e.call().source()}\n" for e in plan.checkpoint)
    # the HF form falls back to the plain wrapper, and its own code needs torch: checkpoint.py always
    whole = next(k for k in ENTRY_KINDS.values() if k.whole)
    runtime = [*whole.runtime * hf, *(r for e in plan.checkpoint for r in e.kind.runtime)]
    body = "".join(_module_source(r, set(runtime)) if embed else _module_line(r) for r in dict.fromkeys(runtime))
    body += _SNIPPET_APPLY.replace("{function}", "_apply_plain" if hf else "apply_checkpointing").replace("{calls}", calls)
    if hf:
        body += _SNIPPET_HF.replace("{names}", names)
    return "\n".join(header) + "\n" + body + "\n\nmodel = apply_checkpointing(model)\n" + sharding_snippet(plan)


def _module_line(name: str) -> str:
    lines = len(_module_source(name, set()).splitlines())
    return f"\n# ckpt_tune/plan/{name}.py ({lines} lines): not shown here; `--patch FILE` writes the snippet whole\n"


def _module_source(name: str, embedded: set[str]) -> str:
    """Runtime module `ckpt_tune.plan.<name>` as snippet code: its docstring as comments, its body as it
    is, less `from __future__` and its imports of other runtime modules (embedded beside it; a name of
    one that is not, which the plan's entries never reach, becomes a stub that says so)."""
    module = runtime_module(name)
    source = inspect.getsource(module)
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    for node in sorted(ast.walk(tree), key=lambda n: -getattr(n, "lineno", 0)):
        ours = isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckpt_tune.plan.")
        if (isinstance(node, ast.Import) and any(a.name.startswith("ckpt_tune") for a in node.names)) or (
            isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckpt_tune") and not ours
        ):
            raise ValueError(f"plan/{name}.py imports {ast.unparse(node)}: a runtime module imports torch and runtime modules only")
        if not ours and not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            continue
        other = (node.module or "").rsplit(".", 1)[-1]
        indent = " " * node.col_offset
        stubs = "" if node.module == "__future__" or other in embedded else "".join(
            f"{indent}def {a.asname or a.name}(*args, **kwargs):  # ckpt_tune/plan/{other}.py: not needed by this plan\n"
            f"{indent}    raise RuntimeError(\"this plan's snippet does not include {other}.py\")\n"
            for a in node.names
        )
        lines[node.lineno - 1 : node.end_lineno] = [stubs]
    doc = module.__doc__ or ""
    body = "".join(lines).split('"""', 2)[2]
    comment = "\n".join(("# " + line).rstrip() for line in doc.strip().splitlines())
    return f"\n# ckpt_tune/plan/{name}.py, verbatim.\n" + comment + "\n" + body
