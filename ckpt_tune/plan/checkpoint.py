"""One module under non-reentrant activation checkpointing, optionally under an op-level policy.

`checkpoint_module(module, policy=None)` replaces the module instance's `forward` with one that runs the
original under `torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)`: only
its inputs are kept for backward, where its forward runs again. Under a `policy` (plan/policy.py) the
outputs of the ops the policy names are kept and the rest recomputed. The module's own hooks (FSDP's
included) stay outside the checkpoint and run once; its name, state_dict keys and hooks are unchanged.

Only memory and time change (docs/design.md §5): the recompute lets BatchNorm update throwaway copies
of its running statistics (pytorch#96136) and drops any other buffer the forward replaces; the random
stream repeats; the arguments' containers are copied at the call and again for each recompute, so a list
the caller grows later (DenseNet's earlier features) or the forward changes in place (HRNet's branches)
reaches the recompute as it was.

This is the wrapper `ckpt_tune.apply` installs and the one the patch snippet (plan/patch.py) embeds as
it is: it imports torch and plan/policy.py only, which the snippet embeds too when the plan has a policy.
"""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch
import torch.utils.checkpoint
from torch import nn

from ckpt_tune.plan.policy import context_fn

CHECKPOINT_FORWARD = "_ckpt_forward"  # the wrapper's name marks a checkpointed module
INNER_ATTR = "_ckpt_inner_forward"  # a forward the instance had before wrapping
POLICY_ATTR = "_ckpt_policy"  # the op-level policy of a module checkpointed under one


def running_stats(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """(norm layer, buffer name, buffer) of every running statistic inside `module`."""
    return [
        (m, name, buf)
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase)
        for name, buf in m._buffers.items()
        if buf is not None
    ]


@contextmanager
def throwaway_running_stats(module: nn.Module, spares: list[torch.Tensor] | None = None):
    """Let every norm layer inside `module` update clones of its running statistics, then put the
    real buffers back (the recompute must not update them a second time: pytorch#96136).

    Clones, not `running_mean=None`: the recompute must run the same kernel with the same arguments,
    so that it saves as many tensors as the first forward (non-reentrant checkpoint matches them by
    position) and its outputs are bit-for-bit those of the first forward. `spares`: clones made before
    the checkpointed region (`[b.clone() for *_, b in running_stats(module)]`), for a region under an
    op policy, whose recompute must run exactly the ops of its forward and no clone.
    """
    kept = running_stats(module)
    # any other buffer a forward replaces (`self.x_min = self.x_min + ...`, Hugging Face's I-BERT range
    # trackers): the recompute's replacement is dropped, the entry put back; nothing is cloned for them
    entries = [(m, dict(m._buffers)) for m in module.modules() if m._buffers]
    if spares is None:
        spares = [buf.clone() for _, _, buf in kept]
    for (m, name, _), spare in zip(kept, spares):
        m._buffers[name] = spare
    try:
        yield
    finally:
        for m, saved in entries:
            m._buffers.update(saved)
        for m, name, buf in kept:
            m._buffers[name] = buf


def inner_forward(module: nn.Module):
    """The module's forward without any wrapper of ours (and without its hooks)."""
    inner = module.__dict__.get(INNER_ATTR)
    return inner if inner is not None else types.MethodType(type(module).forward, module)


def _ckpt_forward(self: nn.Module, *args, **kwargs):
    """The instance-level forward of a checkpointed module (bound with MethodType, so deepcopy binds the copy)."""
    inner = inner_forward(self)
    if not (self.training and torch.is_grad_enabled()):
        return inner(*args, **kwargs)
    calls = 0
    policy = self.__dict__.get(POLICY_ATTR)
    # under an op policy the recompute must run exactly the forward's ops: the throwaway copies of
    # the running statistics are made here, outside the checkpointed region
    spares = [b.clone() for *_, b in running_stats(self)] if policy is not None else None

    # the arguments' containers as they are at the call, for the recompute: a list the caller grows later
    # (DenseNet) or the forward changes in place (HRNet's branches) reaches it as it was
    called = torch.utils._pytree.tree_map(lambda x: x, (args, kwargs))

    def run(*a):
        # checkpoint calls this once in forward and again for each recompute in backward.
        nonlocal calls
        calls += 1
        if calls == 1:
            return inner(*args, **kwargs)  # the caller's own containers, as the plain forward gets them
        a, kw = torch.utils._pytree.tree_map(lambda x: x, (a, called[1]))  # fresh ones for each recompute
        with throwaway_running_stats(self, spares):
            return inner(*a, **kw)

    extra = {"context_fn": context_fn(policy)} if policy is not None else {}
    # kwargs reach `run` by closure, not through checkpoint(), so a module keyword named like one of
    # checkpoint's own (debug, context_fn, determinism_check) cannot collide
    return torch.utils.checkpoint.checkpoint(run, *called[0], use_reentrant=False, preserve_rng_state=True, **extra)


def is_checkpointed(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__name__", None) == CHECKPOINT_FORWARD


def checkpoint_module(module: nn.Module, policy: str | None = None) -> None:
    """Checkpoint `module` (in place; a module checkpointed already is left as it is)."""
    if is_checkpointed(module):
        return
    own = module.__dict__.get("forward")
    if own is not None:
        setattr(module, INNER_ATTR, own)
    if policy is not None:
        setattr(module, POLICY_ATTR, policy)
    module.forward = types.MethodType(_ckpt_forward, module)


def uncheckpoint_module(module: nn.Module) -> None:
    """Undo `checkpoint_module`: the module's forward as it was."""
    if not is_checkpointed(module):
        return
    inner = module.__dict__.pop(INNER_ATTR, None)
    module.__dict__.pop(POLICY_ATTR, None)
    del module.__dict__["forward"]
    if inner is not None:
        module.forward = inner
