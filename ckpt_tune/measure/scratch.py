"""Kernel memory that fake mode cannot see (fake.py; docs/design.md §3).

No op returns the memory a kernel allocates and frees inside itself. On the CPU, oneDNN reorders
convolution inputs and weights into blocked layouts, BatchNorm's backward keeps an input-sized
temporary, and a oneDNN LSTM layer returns a workspace whose size only oneDNN knows (fake mode makes it
empty). For these ops (`CPU_SCRATCH_OPS`) `calibrated` runs the real kernel once per distinct call
signature on zero-filled tensors, under the profiler, and the recorder replays what it allocated. On
CUDA, cuDNN workspaces are not modelled: the calls that would take one (`CUDA_WORKSPACE_OPS`) are
counted as unmodelled.
"""

from __future__ import annotations

import sys

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map_only

from ckpt_tune.measure import timeline

aten = torch.ops.aten

# Ops whose CPU kernels allocate memory that fake mode cannot see (see the module docstring). Found by
# calibrating every aten op of examples/, torchvision and timm CNNs and ViTs, Swin, and Hugging Face BERT,
# T5, Llama, Mixtral and GPT-NeoX steps: everything else allocates at most a few bytes inside (bf16
# matmul packing buffers reach ~2 MiB; not modelled: calibrating a large GEMM costs seconds).
CPU_SCRATCH_OPS = frozenset(
    {
        aten.convolution.default,
        aten.convolution_backward.default,
        aten.native_batch_norm_backward.default,
        aten.mkldnn_rnn_layer.default,
        aten.mkldnn_rnn_layer_backward.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,  # per-thread tile buffers
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        # contiguous copies of strided inputs (attention blocks that transpose), per-thread partial sums
        aten.native_layer_norm.default,
        aten.native_layer_norm_backward.default,
        aten._safe_softmax.default,  # the math attention path's softmax: a per-thread row buffer
        aten.embedding_dense_backward.default,  # sorted copies of the indices
        aten.roll.default,  # Swin's shifted windows: an input-sized temporary
        aten.sort.default,  # MoE token routing
    }
)
# Ops that take a workspace on CUDA which fake mode cannot size (cuDNN convolution workspaces, the cuDNN
# RNN reserve; the CPU graph's oneDNN RNN layers stand for `_cudnn_rnn`): counted, not modelled.
CUDA_WORKSPACE_OPS = frozenset(
    {
        aten.convolution.default,
        aten.convolution_backward.default,
        aten.mkldnn_rnn_layer.default,
        aten.mkldnn_rnn_layer_backward.default,
    }
)
# CUDA caching allocator: every block is a multiple of kMinBlockSize = 512 bytes
# (c10/cuda/CUDACachingAllocator.cpp, round_size).
CUDA_BLOCK_ROUND = 512
# Calibration runs the op for real: skip it (and count the op as unmodelled) above this many bytes of
# real inputs, so a fake run never needs the memory it is meant to predict.
CALIBRATE_LIMIT = 256 << 20

# What a kernel allocates beyond fake mode's view: (bytes of each output, None where fake mode's size is
# right; bytes it holds at its own peak above those outputs).
Scratch = tuple[tuple[int | None, ...], int]

_CALIBRATED: dict[tuple, Scratch | None] = {}  # op call signature -> what the real kernel allocated
_quiet_fd2 = timeline.quiet_stderr  # kineto prints profiler start/stop lines straight to fd 2


def forked_alike() -> bool:
    """Whether a forked process (one torch thread: measure/forked.py) calibrates a CPU kernel's scratch as
    this process runs that kernel: only where this one runs one thread too. oneDNN sizes its buffers by
    the threads it runs (torchvision's ResNet-18 at batch 24: a step 36 MiB higher on two threads than on
    one), so with more, the calls of a batch are calibrated in this process first (docs/design.md §3)."""
    return torch.get_num_threads() == 1


def _signature(func, args, kwargs) -> tuple:
    def one(a):
        if isinstance(a, torch.Tensor):
            return (tuple(a.shape), tuple(a.stride()), a.storage_offset(), a.dtype)
        if isinstance(a, (list, tuple)):
            return tuple(one(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, one(v)) for k, v in a.items()))
        return a

    return (func, one(args), one(kwargs), torch.is_grad_enabled())


def _real_like(t: torch.Tensor) -> torch.Tensor:
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.zeros(max(n, 1), dtype=t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def calibrated(func, args, kwargs) -> Scratch | None:
    """What func's CPU kernel allocates beyond fake mode's view for these args, measured once per call
    signature (`_calibrate`), or None where it cannot be."""
    sig = _signature(func, args, kwargs)
    if sig not in _CALIBRATED:
        _CALIBRATED[sig] = _calibrate(func, args, kwargs)
    return _CALIBRATED[sig]


def _calibrate(func, args, kwargs) -> Scratch | None:
    """Run func for real on zeros shaped like the fake args, under the profiler; None if it cannot be."""
    fakes = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    if sum(a.untyped_storage().nbytes() for a in fakes) > CALIBRATE_LIMIT:
        return None
    if torch.autograd._profiler_enabled():  # a profiler cannot nest in another
        return None
    try:
        return _run_real(func, args, kwargs)
    except Exception:  # a kernel that rejects zeros or these args: its scratch stays unmodelled
        return None


def _run_real(func, args, kwargs) -> Scratch:
    # Grad mode as the caller has it: oneDNN RNN layers keep a workspace only under grad mode.
    with unset_fake_temporarily():
        rargs, rkwargs = tree_map_only(torch.Tensor, _real_like, (args, kwargs))
        if func is aten.native_batch_norm_backward.default and rargs[2] is not None:
            # fake mode gives bf16 inputs bf16 saved statistics; the CPU kernel keeps them in the
            # parameters' dtype and insists on it
            rargs = (*rargs[:5], *(t if t is None else t.to(rargs[2].dtype) for t in rargs[5:7]), *rargs[7:])
        if func is aten.mkldnn_rnn_layer_backward.default:
            # the backward reads the forward's workspace, which the fake forward left empty
            a = list(rargs)
            with torch.enable_grad():  # backward runs without grad mode, the workspace needs it
                fwd = aten.mkldnn_rnn_layer.default(*a[0:7], a[13], a[20], a[14], a[15], a[16], a[17], a[19], a[21], True)
            a[22] = fwd[3]
            rargs = tuple(a)
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((rargs, rkwargs))[0] if isinstance(t, torch.Tensor)}
        with _quiet_fd2(), torch.autograd.profiler.profile(profile_memory=True, use_kineto=True) as prof:
            out = func(*rargs, **rkwargs)
        mem = sorted(
            (e.start_ns(), i, int(e.nbytes()))
            for i, e in enumerate(prof.kineto_results.events())
            if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
        )
        live = top = 0
        for _t, _i, d in mem:
            live += d
            top = max(top, live)
        sizes, seen = [], set()
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                sizes.append(0)
                continue
            p = t.untyped_storage().data_ptr()
            sizes.append(0 if p in inputs or p in seen else t.untyped_storage().nbytes())
            seen.add(p)
    return tuple(sizes), max(0, top - sum(sizes))


def batch_norm_sizes(args) -> Scratch | None:
    # Fake mode gives a bf16 input bf16 saved mean and invstd; the kernels (CPU and CUDA) keep them in
    # the parameters' dtype, fp32 under autocast.
    x, weight = args[0], args[1] if len(args) > 1 else None
    if weight is None or weight.dtype == x.dtype:
        return None
    stats = x.shape[1] * weight.element_size() if args[5] else 0  # training: saved per channel
    return (None, stats, stats), 0


# -- bitsandbytes 4-bit layers (measure/quantized.py) --------------------------------------------------


def bnb_scratch_ops() -> frozenset:
    """The bitsandbytes ops whose kernels allocate memory fake mode cannot see (none unless a model
    imported bitsandbytes): `gemm_4bit`, a 4-bit layer's forward, dequantizes its weight inside."""
    if "bitsandbytes" not in sys.modules:
        return frozenset()
    return frozenset({torch.ops.bitsandbytes.gemm_4bit.default})


def _cuda_block(n: int) -> int:
    return -(-n // CUDA_BLOCK_ROUND) * CUDA_BLOCK_ROUND


def bnb_cuda_scratch(func, args, kwargs) -> Scratch | None:
    """`gemm_4bit`'s scratch on CUDA: the weight dequantized to the activation's dtype and the fp32 absmax,
    each a block of the caching allocator. bitsandbytes 0.50 takes this dequantize-then-`linear` path
    above 1536 rows (M = batch x tokens), where training steps run; below it a fused kernel that may
    dequantize nothing, sized here as the same path (an upper bound). None for any other op."""
    if func not in bnb_scratch_ops():
        return None
    # the dispatcher passes schema arguments positionally: name them from the schema
    named = {**dict(zip((x.name for x in func._schema.arguments), args)), **kwargs}
    a, shape = named["A"], named["shapeB"]
    n_out, n_in = int(shape[0]), int(shape[1])
    absmax_8bit = named.get("absmax_8bit")
    nested = isinstance(absmax_8bit, torch.Tensor)
    blocks = (absmax_8bit if nested else named["absmax"]).numel()
    held = _cuda_block(blocks * 4) + _cuda_block(n_out * n_in * a.element_size())
    # double quantization: the dequantized absmax and the offset added to it are alive together first
    first = 2 * _cuda_block(blocks * 4) if nested else 0
    return (None,), max(held, first)
