"""The patch snippet: Python source a user pastes after building the model, torch only.

It checkpoints the plan's entries exactly as `ckpt_tune.apply` does (plan/apply.py), with the same
attribute names, so `applied_names` and `remove` recognise modules wrapped by either. Segments embed
plan/segment.py verbatim. A plan for several ranks then shards the model as `ckpt_tune.shard` does
(plan/shard.py), with torch's public API: `fully_shard` on each shard unit and the root, or for zero1 a
`ZeroRedundancyOptimizer` to build the optimizer with. Checkpoint wrappers first, sharding second.
"""

from __future__ import annotations

import inspect
import json

from ckpt_tune.plan import offload, policy, segment
from ckpt_tune.plan.entry import Action, Entry
from ckpt_tune.plan.file import Plan
from ckpt_tune.plan.finetune import peft_code
from ckpt_tune.plan.shard import ENGINES, MIXED
from ckpt_tune.units import format_bytes

# The wrapper of the patch snippet: the same logic, names and guards as ckpt_tune/plan/apply.py (tests run
# both on the same models and compare every gradient), written with torch alone.
_SNIPPET_WRAPPER = """
import types

import torch
import torch.utils.checkpoint

CKPT_MODULES = {names}


def _ckpt_forward(self, *args, **kwargs):
    # Checkpoint the module's own forward; its hooks (FSDP's too) stay outside and run once.
    inner = self.__dict__.get("_ckpt_inner_forward") or types.MethodType(type(self).forward, self)
    if not (self.training and torch.is_grad_enabled()):
        return inner(*args, **kwargs)
    calls = []
    norms = [m for m in self.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)]
    policy = self.__dict__.get("_ckpt_policy")
    # under an op policy the recompute must run exactly the forward's ops: copies made out here
    spares = [b.clone() for m in norms for b in m._buffers.values() if b is not None] if policy else None

    def run(*a):
        calls.append(None)
        if len(calls) == 1:
            return inner(*a, **kwargs)
        # Recompute in backward: BatchNorm would update its running stats a second time
        # (pytorch#96136). Let it update throwaway copies; its output is bit-for-bit the same.
        kept = [(m, k, b) for m in norms for k, b in m._buffers.items() if b is not None]
        # a buffer the forward replaces (self.x_min = self.x_min + ...): the recompute's replacement is dropped
        entries = [(m, dict(m._buffers)) for m in self.modules() if m._buffers]
        for (m, k, b), spare in zip(kept, spares or [b.clone() for *_, b in kept]):
            m._buffers[k] = spare
        try:
            return inner(*a, **kwargs)
        finally:
            for m, saved in entries:
                m._buffers.update(saved)
            for m, k, b in kept:
                m._buffers[k] = b

    extra = {"context_fn": context_fn(policy)} if policy else {}
    # the arguments as they are now: containers are copied, so a list the caller grows later (DenseNet's
    # earlier features) reaches the recompute as it was
    args, kwargs = torch.utils._pytree.tree_map(lambda x: x, (args, kwargs))
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **extra)


def {plain_name}(model):
    for m in model.modules():  # Hugging Face: the recompute would fill the KV cache twice
        if getattr(getattr(m, "config", None), "use_cache", None) is True:
            m.config.use_cache = False
    for name in CKPT_MODULES:
{offload_branch}{policy_branch}{segment_branch}
        module = model.get_submodule(name)
        own = module.__dict__.get("forward")
        if getattr(own, "__name__", None) == "_ckpt_forward":
            continue  # already wrapped
        if own is not None:
            module._ckpt_inner_forward = own
{policy_set}        module.forward = types.MethodType(_ckpt_forward, module)
    return model
"""

_SNIPPET_SEGMENT_BRANCH = """        if not isinstance(name, str):  # a segment: these consecutive blocks under one checkpoint
            if getattr(model.get_submodule(name[0]).__dict__.get("forward"), "__name__", None) != SEGMENT_FORWARD:
                checkpoint_segment(model, list(name))
            continue
"""

_SNIPPET_OFFLOAD_BRANCH = """        if isinstance(name, dict) and name.get("action") == "offload":  # saved tensors kept in host memory
            offload(model.get_submodule(name["module"]))
            continue
"""

_SNIPPET_POLICY_BRANCH = """        policy = None
        if isinstance(name, dict):  # a module under an op policy: keep the outputs of the ops it names
            name, policy = name["module"], name["policy"]
"""
_SNIPPET_POLICY_SET = """        if policy is not None:
            module._ckpt_policy = policy
"""

# Hugging Face form: transformers' own per-layer switch (GradientCheckpointingLayer.gradient_checkpointing,
# transformers >= 4.52), falling back to the plain wrapper when a planned module is not such a layer.
_SNIPPET_HF = """

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


def patch_snippet(plan: Plan, *, hf: bool = False) -> str:
    """Python source to paste into a training script after the model is built: it checkpoints the
    plan's modules exactly as `ckpt_tune.apply` does, with torch only (no ckpt_tune import), and for a
    plan of several ranks then shards the model as `ckpt_tune.shard` does (`sharding_snippet`).

    `hf=True` uses Hugging Face's per-layer switch when every planned module is a
    GradientCheckpointingLayer, and the plain wrapper otherwise.
    """
    per_step = plan.batch_size * plan.grad_accum_steps
    offloads = any(e.action is Action.OFFLOAD for e in plan.checkpoint)
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
        f"# Recompute{' and host transfers (modelled)' * offloads} add{'s' * (not offloads)} about "
        f"{plan.predicted_recompute_fraction:.1%} to the step time.",
        f"# Paste after building `model`, {paste}",
    ]
    if plan.peft is not None:  # the model the plan was measured on: the names below are the peft model's
        header += [
            f"# The plan was measured with {plan.peft.method} ({plan.peft.describe()}); build `model` this way:",
            *(f"#   {code_line}".rstrip() for code_line in peft_code(plan.peft).splitlines()),
        ]
    segments = any(e.is_segment for e in plan.checkpoint)
    policies = any(e.policy is not None for e in plan.checkpoint)
    # Hugging Face's per-layer switch cannot checkpoint several layers as one, nor under an op policy
    hf = hf and not segments and not policies and not offloads

    def literal(e: Entry) -> str:  # json.dumps writes a valid Python string literal for any name
        names = [json.dumps(n) for n in e.modules]
        if e.action is Action.OFFLOAD:
            return f'{{"module": {names[0]}, "action": "offload"}}'
        if e.policy is not None:
            return f'{{"module": {names[0]}, "policy": {json.dumps(e.policy)}}}'
        return names[0] if not e.is_segment else "(" + ", ".join(names) + ")"

    names = (
        "["
        + "".join(f"\n    {literal(e)}," for e in plan.checkpoint)
        + ("\n]" if plan.checkpoint else "]")
    )
    body = _SNIPPET_WRAPPER.replace("{names}", names).replace(
        "{plain_name}", "_apply_plain" if hf else "apply_checkpointing"
    )
    body = body.replace("{offload_branch}", _SNIPPET_OFFLOAD_BRANCH if offloads else "")
    body = body.replace("{policy_branch}", _SNIPPET_POLICY_BRANCH if policies else "")
    body = body.replace("{segment_branch}\n", _SNIPPET_SEGMENT_BRANCH if segments else "")
    body = body.replace("{policy_set}", _SNIPPET_POLICY_SET if policies else "")
    if policies:
        body = _module_source(policy, "Op-level policies (ckpt_tune/plan/policy.py, verbatim)") + body
    else:  # no policy in the plan: the wrapper's `context_fn` is never called
        body = body.replace('extra = {"context_fn": context_fn(policy)} if policy else {}', "extra = {}")
    if offloads:
        body = _module_source(offload, "Activation offload (ckpt_tune/plan/offload.py, verbatim)") + body
    if segments:
        body = _module_source(segment, "Segments: consecutive blocks under one checkpoint (ckpt_tune/plan/segment.py, verbatim)") + body
    if hf:
        body += _SNIPPET_HF
    return "\n".join(header) + "\n" + body + "\n\nmodel = apply_checkpointing(model)\n" + sharding_snippet(plan)


def _module_source(module, title: str) -> str:
    """A torch-only module of ckpt_tune/plan as snippet code: its docstring as comments, no `from __future__`."""
    text = inspect.getsource(module)
    doc = module.__doc__ or ""
    body = text.split('"""', 2)[2].replace("from __future__ import annotations\n", "")
    comment = "\n".join(("# " + line).rstrip() for line in doc.strip().splitlines())
    return f"\n# {title}.\n" + comment + "\n" + body
