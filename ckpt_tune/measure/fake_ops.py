"""Ops as the recording modes of measure/fake.py see them (docs/design.md §3): `SHORTCUTS`
(`tensor.device` and `record_function` ranges, answered as fake mode would, without dispatching them
further), `fresh` (ops whose outputs are all new storages), `written_in_place` (what backward writes in
place on plain tensors), `MetaGaps` (outputs for ops whose meta kernel refuses what the CPU kernel runs,
or lays out otherwise) and `eager_hf_masks` (Hugging Face's eager mask path under fake tensors)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

aten = torch.ops.aten

RECORD_FUNCTION_ENTER = torch.ops.profiler._record_function_enter_new.default
RECORD_FUNCTION_EXIT = torch.ops.profiler._record_function_exit._RecordFunction
# `tensor.device` under a dispatch mode: the most frequent op of a step (FSDP2 and autograd ask it
# thousands of times), which allocates nothing
DEVICE = torch.ops.prim.device.default


def _device(func, args):
    """`tensor.device` as FakeTensor answers it (fake_tensor.py), without dispatching it further."""
    t = args[0]
    if type(t) is FakeTensor and not t.fake_mode.in_kernel_invocation:
        return t.fake_device
    return func(*args)


def _record_function(func, args, kwargs):
    """A `record_function` range (FSDP2 opens one per hook) as the fake mode runs it (fake_impls.py),
    without dispatching it further: the real op on entry, nothing on exit."""
    if func is RECORD_FUNCTION_EXIT:
        return None
    with _disable_current_modes():
        return func(*args, **kwargs)


# ops the fake mode answers without fake tensors, answered here as it would (a third of a step's ops)
SHORTCUTS = {DEVICE: lambda func, args, kwargs: _device(func, args), RECORD_FUNCTION_ENTER: _record_function, RECORD_FUNCTION_EXIT: _record_function}


@contextlib.contextmanager
def cpu_rng_states() -> Iterator[None]:
    """`torch.get_rng_state()` gives a fake tensor of the real state's size while recording with the
    CPU allocator's rules. A checkpoint keeps the CPU generator's state from its forward to its
    recompute, and `fork_rng` holds another copy during the recompute: real CPU tensors (5,056 B each)
    in the real step, made outside the dispatcher, so a fake step would miss them. `set_rng_state`
    ignores a fake state (a fake step draws no random numbers)."""
    get, set_ = torch.get_rng_state, torch.set_rng_state

    def fake_get() -> torch.Tensor:
        real = get()
        return torch.empty(real.shape, dtype=real.dtype)  # under the fake mode: a recorded fake storage

    def fake_set(state: torch.Tensor) -> None:
        if not isinstance(state, FakeTensor):
            set_(state)

    torch.get_rng_state, torch.set_rng_state = fake_get, fake_set
    try:
        yield
    finally:
        torch.get_rng_state, torch.set_rng_state = get, set_


@contextlib.contextmanager
def eager_hf_masks() -> Iterator[None]:
    """Hugging Face models take a fake tensor for a sign of tracing (torch.export) and then build the
    attention mask they skip in eager runs: `find_packed_sequence_indices` cannot read the position ids,
    so every step would materialise a (batch, 1, T, T) mask and run attention with it (and repeat the
    key/value heads of grouped-query attention instead of passing them as they are). A real run of
    sequences that are not packed finds no packing and skips that mask; under fake tensors the position
    ids are taken as not packed, as in that run (docs/design.md §3). Only while recording, and only
    where transformers is already imported."""
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    find = getattr(masking, "find_packed_sequence_indices", None)
    if find is None:
        yield
        return

    def unpacked_if_fake(position_ids, *args, **kwargs):
        if isinstance(position_ids, FakeTensor):
            return None
        return find(position_ids, *args, **kwargs)

    masking.find_packed_sequence_indices = unpacked_if_fake
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = find


# --- what an op's outputs are ----------------------------------------------------------------------

_FRESH: dict[Any, bool] = {}


def fresh(func) -> bool:
    """Whether every output of func is a new storage: an aten op whose schema lets no output alias an
    input and writes no input (view and in-place ops are annotated; custom ops' schemas may omit it:
    FSDP2's `all_gather_copy_in` returns its input). Such an op's outputs need no comparison with
    its inputs (`fake.FakeRecorder._see`): that comparison made 18% of a 7B step's Python calls."""
    fresh = _FRESH.get(func)
    if fresh is None:
        schema = getattr(func, "_schema", None)
        fresh = (
            getattr(func, "namespace", None) == "aten"
            and schema is not None
            and all(r.alias_info is None for r in schema.returns)
            and not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        )
        _FRESH[func] = fresh
    return fresh


# Out-of-place ops that backward on plain tensors runs in place, into a tensor that dies with the call
# (`written_in_place`): the engine's sum of two gradients, and the scatters of formulas
# into fresh zeros (gather, index_select, masked_select, max/min/sort/topk along a dim, cummax/cummin,
# trace, take, indexing)
IN_PLACE_IN_BACKWARD = frozenset({
    aten.add.Tensor, aten.scatter_add.default, aten.index_add.default, aten.masked_scatter.default,
    aten.scatter.src, aten.index_fill.int_Tensor, aten.put.default, aten.index_put.default,
})  # fmt: skip


def written_in_place(func, args: tuple, kwargs: dict, out: Any) -> torch.Tensor | None:
    """The argument `out` would have been written into on plain tensors, or None. Backward on plain
    tensors writes some results into a tensor that dies with the call: autograd adds a tensor's second
    gradient into its first when it holds the last references to it (torch/csrc/autograd/input_buffer.cpp),
    and formulas such as gather's scatter into fresh zeros (`result.scatter_add_`, FunctionsManual.cpp).
    Under a dispatch mode every tensor is "subclass like", and both take the out-of-place op instead,
    whose result gets a storage of its own. The recorder takes the result as written into this argument
    when the argument's storage dies right after the result is born (`FakeRecorder._maybe_in_place`,
    docs/design.md §3)."""
    node = None if func not in IN_PLACE_IN_BACKWARD or torch.is_grad_enabled() else torch._C._current_autograd_node()
    if node is None:
        return None
    if func is aten.add.Tensor and (
        kwargs or len(args) != 2
        # the gradients of a parameter used twice (T5's shared embedding): out of place on the CPU too
        or any(type(n).__name__ == "AccumulateGrad" for n, _ in node.next_functions if n is not None)
    ):
        return None
    a = args[0] if args else None
    if not (isinstance(a, torch.Tensor) and isinstance(out, torch.Tensor)):
        return None
    if a.shape != out.shape or a.stride() != out.stride() or a.dtype != out.dtype:
        return None
    return a if a.is_contiguous() or a.is_contiguous(memory_format=torch.channels_last) else None


# --- ops whose meta kernel rejects what the CPU kernel runs, or lays out its output otherwise ---------


def _grouped_mm_output(func, args, kwargs) -> torch.Tensor | None:
    """`aten._grouped_mm` (MoE experts in transformers): the meta kernel demands bf16 (CUDA's rule), the
    CPU kernel takes any float dtype. Same output as the meta kernel's CPU branch, for any dtype."""
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    out_dtype = (args[4] if len(args) > 4 else kwargs.get("out_dtype")) or a.dtype
    if a.dtype == b.dtype == torch.bfloat16 or a.dtype != b.dtype or not a.is_floating_point():
        return None  # the meta kernel's own checks apply
    if a.dim() == 2 and b.dim() == 2:
        size = [offs.size(0), a.size(0), b.size(1)]
    elif a.dim() == 2:
        size = [a.size(0), b.size(-1)]
    elif b.dim() == 2:
        size = [a.size(1), b.size(1)]
    else:
        size = [a.size(0), a.size(1), b.size(-1)]
    return torch.empty(size, dtype=out_dtype, device=a.device)


def _suggested_format(t: torch.Tensor) -> torch.memory_format:
    """ATen's `suggest_memory_format`: channels-last where t is laid out so and not plainly contiguous."""
    for fmt, dim in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if t.dim() == dim and t.is_contiguous(memory_format=fmt) and not t.is_contiguous():
            return fmt
    return torch.contiguous_format


def _laid_out(out: tuple, fmt: torch.memory_format) -> tuple:
    """out with its first tensor (the input's gradient) in memory format fmt, as the kernels allocate it."""
    dx = out[0]
    if not isinstance(dx, torch.Tensor) or dx.is_contiguous(memory_format=fmt):
        return out
    return (torch.empty(dx.shape, dtype=dx.dtype, device=dx.device, memory_format=fmt), *out[1:])


def _norm_backward(input_at: int, fmt=None):
    """A normalisation's backward, its input's gradient laid out as the CPU and CUDA kernels allocate it:
    contiguous for layer norm (which normalises a contiguous copy of its input), the input's suggested
    format for batch and group norm. The meta kernels follow the incoming gradient's strides instead: a
    transposed gradient made the next view of the result a copy that the real step does not make."""

    def fill(func, args, kwargs) -> tuple:
        return _laid_out(func(*args, **kwargs), fmt or _suggested_format(args[input_at]))

    return fill


META_GAPS = {
    aten._grouped_mm.default: _grouped_mm_output,
    aten.native_layer_norm_backward.default: _norm_backward(1, torch.contiguous_format),
    aten.native_batch_norm_backward.default: _norm_backward(1),
    aten.native_group_norm_backward.default: _norm_backward(1),
}


class MetaGaps(TorchDispatchMode):
    """Outputs for the few ops whose meta kernel refuses inputs the CPU kernel accepts, or lays out an
    output otherwise than the kernels do (`META_GAPS`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SHORTCUTS:
            return SHORTCUTS[func](func, args, kwargs)
        fill = META_GAPS.get(func)
        out = fill(func, args, kwargs) if fill is not None else None
        return func(*args, **kwargs) if out is None else out
