"""Op-level policies: which ops of a checkpointed module keep their output, and which are recomputed.

A policy is a fixed rule over the aten ops a module runs (as a `TorchDispatchMode` sees them, after
autograd), applied with PyTorch's public selective-checkpoint API
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`): an op the rule saves is `MUST_SAVE`
(its output is kept from the forward and reused in backward), every other op is `PREFER_RECOMPUTE`.
The module is still checkpointed as a whole (its input is kept, its forward re-runs in backward), so
gradients, the random stream and BatchNorm statistics are those of plain checkpointing.

The set is small and fixed (docs/design.md §7):

    matmuls        keep the outputs of matrix products, convolutions and attention; recompute the rest
                   (norms, activations, dropout, softmax, residual adds): the cheap ops hold most bytes
    half-matmuls   the same, but recompute every second matrix product of the module (counted in call
                   order, forward and recompute alike): torchtitan's selective "op" rule, with the
                   matrix products of every kind
    attention      keep only the attention kernels' outputs (fused scaled-dot-product attention);
                   recompute the rest, matrix products included

This module is torch-only (no other ckpt_tune import) so that the patch snippet can embed it verbatim.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

POLICY_DOCS = {
    "matmuls": "keep matmul, conv and attention outputs; recompute the rest",
    "half-matmuls": "as matmuls, but recompute every second matmul",
    "attention": "keep only attention outputs; recompute the rest",
}
POLICIES = tuple(POLICY_DOCS)


def _ops(*names: str) -> frozenset:
    """The overloads named `aten.<name>`, skipping those this torch lacks (torch >= 2.4 is supported)."""
    found = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            found |= {getattr(packet, o) for o in packet.overloads()}
    return frozenset(found)


MATMUL_OPS = _ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "_convolution")
ATTENTION_OPS = _ops(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


class OpRule:
    """One region's decisions under a policy: `saves(op)` is called for every op in call order (its
    own matmul counter, so a recompute decides exactly as the forward did)."""

    def __init__(self, policy: str) -> None:
        if policy not in POLICY_DOCS:
            raise ValueError(f"unknown op policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy = policy
        self.matmuls = 0

    def saves(self, op) -> bool:
        if op in ATTENTION_OPS:
            return True
        if op not in MATMUL_OPS or self.policy == "attention":
            return False
        self.matmuls += 1
        return not (self.policy == "half-matmuls" and self.matmuls % 2 == 0)


def context_fn(policy: str):
    """`context_fn` for `torch.utils.checkpoint.checkpoint` applying `policy` to one region."""

    def make():
        rules = {False: OpRule(policy), True: OpRule(policy)}  # forward, recompute: counted apart

        def decide(ctx, op, *args, **kwargs):
            keep = rules[ctx.is_recompute].saves(op)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(decide)

    return make

