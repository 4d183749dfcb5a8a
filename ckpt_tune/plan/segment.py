"""One non-reentrant checkpoint over a run of consecutive blocks (a segment), with torch alone.

The parent module calls the blocks one after another (`for block in self.blocks: x = block(x, mask)`).
The first block's call opens one checkpoint region and the last block's call closes it, so none of the
tensors the blocks save is kept: only the first block's inputs are held, and in backward the whole run
is recomputed at once. The recompute calls the blocks' own forwards again with the arguments they had,
except that an argument that was an output of an earlier block of the run is replaced by its
recomputed value, so no output in the middle of the run is held from forward to backward.

Compared with checkpointing each block, a segment keeps one input instead of one per block and
recomputes the same forwards, but its backward holds the saved tensors of all its blocks at once.

Like `torch.utils.checkpoint.checkpoint(use_reentrant=False)` it preserves the RNG state (dropout
masks repeat), and the recompute lets BatchNorm update throwaway copies of its running statistics
(pytorch#96136), so a segment changes memory and time only. The region is opened and closed with the
generator that `torch.utils.checkpoint` and `torch.distributed`'s composable `checkpoint` are built on.

Everything between the blocks' calls runs inside the region. Code of the parent that saves tensors for
backward between two blocks of a segment would not be recomputed: backward then stops with
torch.utils.checkpoint's error instead of computing anything wrong.

This file imports torch and plan/checkpoint.py only: the patch snippet (ckpt_tune/plan/patch.py)
embeds both as they are, that one first.
"""

from __future__ import annotations

import contextlib
import inspect
import types
import weakref

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils import _pytree as pytree

from ckpt_tune.plan.checkpoint import INNER_ATTR, inner_forward, throwaway_running_stats

SEGMENT_FORWARD = "_ckpt_segment_forward"  # the instance forward of a segment's block
SEGMENT_ATTR = "_ckpt_segment"  # (Segment, position) on each block of a segment


def _no_dispatch_modes():
    """A context without the active Python dispatch modes (FakeTensorMode, profilers' modes)."""
    from torch.utils import _python_dispatch

    disable = getattr(_python_dispatch, "_disable_current_modes", None)
    return disable() if disable is not None else contextlib.nullcontext()


def _is_fake(t: torch.Tensor) -> bool:
    """Whether `t` is a fake tensor (a state with no values to compare)."""
    return type(t).__name__ == "FakeTensor"


def _inside_a_checkpoint() -> bool:
    """Whether this call runs inside a region of `torch.utils.checkpoint` (its forward or its
    recompute): the model's own checkpoint call around a block, whose region ends when that block
    returns. A segment's region opened there would end after it, and saved-tensor hooks, a stack, must
    end in the order they began."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(True) if top is not None else None
    name = getattr(hooks[0], "__qualname__", "") if hooks else ""
    return name.startswith(("_checkpoint_hook.", "_recomputation_hook."))


def _in_backward() -> bool:
    """Whether this runs inside a backward pass (a reentrant checkpoint's recompute)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def available() -> bool:
    """Whether this torch has the non-reentrant checkpoint generator segments are built on."""
    return callable(getattr(torch.utils.checkpoint, "_checkpoint_without_reentrant_generator", None))


def _open_region(replay, args: tuple):
    """Start torch.utils.checkpoint's non-reentrant region; `replay(*args)` recomputes it in backward."""
    gen = torch.utils.checkpoint._checkpoint_without_reentrant_generator
    # its options (preserve_rng_state, context_fn, determinism_check, debug, early_stop in recent
    # torch) precede *args: pass their defaults positionally, whichever torch this is
    defaults = [
        p.default
        for p in list(inspect.signature(gen).parameters.values())[1:]
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    region = gen(replay, *defaults, *args)
    next(region)
    return region


class _Out:
    """Placeholder in a recorded call: leaf `leaf` of the output of the segment's block `block`."""

    __slots__ = ("block", "leaf")

    def __init__(self, block: int, leaf: int) -> None:
        self.block, self.leaf = block, leaf


class Segment:
    """Consecutive blocks checkpointed as one region; `wrap` installs it on the blocks."""

    def __init__(self, blocks: list[nn.Module], name: str = "segment") -> None:
        if len(blocks) < 2:
            raise ValueError("a segment needs two or more blocks")
        self.blocks, self.name = list(blocks), name
        self.region = None  # the open region, from the first block's call to the last one's return
        self.calls: list = []  # this forward's recorded calls (block 0: its kwargs only)
        self.outputs: dict[int, tuple] = {}  # id(tensor) -> (weakref, block, leaf, version) of this forward
        self.hook = None
        self.rng_after = None  # random state when the last block returned, until the next one starts

    def wrap(self, root: nn.Module | None = None) -> None:
        """Wrap the blocks. With `root` (the model), a region its forward left open (code between the
        blocks raised, or returned before the last block) is closed when that forward ends."""
        for pos, block in enumerate(self.blocks):
            own = block.__dict__.get("forward")
            if own is not None:
                setattr(block, INNER_ATTR, own)
            setattr(block, SEGMENT_ATTR, (self, pos))
            block.forward = types.MethodType(_ckpt_segment_forward, block)
        if root is not None:
            self.hook = root.register_forward_hook(self._after_forward, always_call=True)

    def unwrap(self) -> None:
        """Close a region left open and undo `wrap`: the blocks are unwrapped even where closing fails."""
        try:
            self.close()
        finally:
            if self.hook is not None:
                self.hook.remove()
                self.hook = None
            for block in self.blocks:
                unwrap_segment_block(block)

    def _after_forward(self, module, args, output) -> None:
        if self.region is not None:
            self.close()

    def _replay(self, calls: list):
        def replay(*first_args):
            outs: list[list] = []
            for pos, block in enumerate(self.blocks):
                if pos == 0:  # fresh containers: the forward may change its list argument in place
                    args, kwargs = pytree.tree_map(lambda x: x, (first_args, calls[0]))
                else:
                    spec, rng = calls[pos]
                    args, kwargs = pytree.tree_map(lambda x: outs[x.block][x.leaf] if isinstance(x, _Out) else x, spec)
                    if rng is not None:  # code between the blocks drew random numbers: start where it did
                        torch.set_rng_state(rng[0])
                        if rng[1]:
                            torch.utils.checkpoint.set_device_states(rng[1], rng[2])
                with throwaway_running_stats(block):
                    out = inner_forward(block)(*args, **kwargs)
                outs.append(pytree.tree_flatten(out)[0])

        return replay

    def call(self, pos: int, args: tuple, kwargs: dict):
        try:
            if pos == 0:
                self.close()  # a region an earlier forward left open
                if _inside_a_checkpoint():
                    raise RuntimeError(
                        f"checkpoint {self.name}: its first block runs inside a checkpoint the model makes itself "
                        "(torch.utils.checkpoint), which ends before the segment's last block: checkpoint these "
                        "blocks one by one"
                    )
                # the arguments as they are now: containers copied, so a list the caller grows later
                # or the block changes in place reaches the recompute as it was (docs/design.md §5)
                called, called_kwargs = pytree.tree_map(lambda x: x, (args, kwargs))
                self.calls, self.outputs = [called_kwargs], {}
                self.region = _open_region(self._replay(self.calls), called)
            else:
                if self.region is None or len(self.calls) != pos:
                    raise RuntimeError(
                        f"checkpoint {self.name}: block {pos} of the segment ran out of order "
                        "(its blocks must run one after another, first to last, once per forward)"
                    )
                spec = pytree.tree_map(self._as_placeholder, (args, kwargs))
                self.calls.append((spec, self._rng_if_moved(args, kwargs)))
            out = inner_forward(self.blocks[pos])(*args, **kwargs)
        except BaseException:
            self.close()
            raise
        for leaf, t in enumerate(pytree.tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor):
                self.outputs[id(t)] = (weakref.ref(t), pos, leaf, t._version)
        if pos == len(self.blocks) - 1:
            self.close(finished=True)
        else:
            self.rng_after = self._rng_states(args, kwargs)
        return out

    @staticmethod
    def _rng_states(args: tuple, kwargs: dict) -> tuple:
        return (torch.get_rng_state(), *torch.utils.checkpoint.get_device_states(*args, *kwargs.values()))

    def _rng_if_moved(self, args: tuple, kwargs: dict):
        """The random state now, if it is not where the previous block left it (else None: the replay,
        running the blocks back to back, is already there)."""
        now, before = self._rng_states(args, kwargs), self.rng_after
        self.rng_after = None
        # recorded with the CPU allocator's rules, the CPU state is a fake tensor (measure/fake_ops.py
        # cpu_rng_states), with no values to compare: a fake step draws no random numbers
        if before is not None and _is_fake(now[0]):
            return None
        # otherwise RNG states are real byte tensors, even under another dispatch mode: compare them
        # outside any mode (a mode would see a data-dependent op and fail)
        with _no_dispatch_modes():
            same = before is not None and torch.equal(now[0], before[0]) and now[1] == before[1] and all(
                torch.equal(a, b) for a, b in zip(now[2], before[2], strict=True)
            )
        return None if same else now

    def _as_placeholder(self, x):
        if isinstance(x, torch.Tensor):
            hit = self.outputs.get(id(x))
            if hit is not None and hit[0]() is x:
                if x._version != hit[3]:
                    raise RuntimeError(
                        f"checkpoint {self.name}: the output of block {hit[1]} was changed in place before "
                        "the next block of the segment ran; the recompute cannot repeat that: checkpoint "
                        "these blocks one by one"
                    )
                return _Out(hit[1], hit[2])
        return x

    def close(self, finished: bool = False) -> None:
        # the recorded calls now belong to the region's replay alone (freed with the autograd graph)
        region, self.region, self.outputs, self.calls, self.rng_after = self.region, None, {}, [], None
        if region is None:
            return
        if finished:
            try:
                next(region)
            except StopIteration:
                return
            raise RuntimeError(f"checkpoint {self.name}: the region did not close")
        region.close()


def _ckpt_segment_forward(self: nn.Module, *args, **kwargs):
    """The instance forward of a block in a segment (bound with MethodType). Whether the segment is
    checkpointed is decided at its first block; while its region is open every block goes through it."""
    segment, pos = self.__dict__[SEGMENT_ATTR]
    # not in backward: a reentrant checkpoint's recompute of the first block, whose forward ran without
    # grad and so without the segment, runs it as that forward did
    if segment.region is not None or (pos == 0 and self.training and torch.is_grad_enabled() and not _in_backward()):
        return segment.call(pos, args, kwargs)
    return inner_forward(self)(*args, **kwargs)


def is_segment(blocks: list[nn.Module]) -> bool:
    """True when `blocks` are already wrapped as exactly one segment, in this order."""
    marks = [b.__dict__.get(SEGMENT_ATTR) for b in blocks]
    return all(m is not None for m in marks) and len(marks[0][0].blocks) == len(blocks) and all(
        m[0] is marks[0][0] and m[1] == i and m[0].blocks[i] is b for i, (m, b) in enumerate(zip(marks, blocks, strict=True))
    )


def checkpoint_segment(model: nn.Module, names: list[str]) -> None:
    """Checkpoint the consecutive blocks `names` of `model` as one segment, in place (blocks that are
    this segment already are left as they are)."""
    blocks = [model.get_submodule(n) for n in names]
    if not is_segment(blocks):
        Segment(blocks, f"segment {names[0]}..{names[-1]}").wrap(root=model)


def unwrap_segment_block(block: nn.Module) -> None:
    """Undo `Segment.wrap` on one block."""
    block.__dict__.pop(SEGMENT_ATTR, None)
    inner = block.__dict__.pop(INNER_ATTR, None)
    block.__dict__.pop("forward", None)
    if inner is not None:
        block.forward = inner
