"""bitsandbytes 4-bit layers: the memory they hold outside their parameters, under fake tensors, and the
scratch of their kernels (docs/design.md §3).

A `Linear4bit`'s weight is a `Params4bit` of packed 4-bit codes; its quantization state (per-block
absmax, 8-bit with double quantization, and the second level's fp32 absmax and code books) hangs off
the weight as `quant_state`, outside the module's parameters and buffers: `state_tensors` names those
tensors so the weights part counts them.

Under fake tensors a `Params4bit` cannot hold a fake tensor (`Tensor._make_subclass` refuses one), so
the layer is carried as bitsandbytes itself carries it after FSDP flattened it: a plain parameter of the
packed shape, with `quant_state` and the quantization attributes set on it (bitsandbytes'
`fix_4bit_weight_quant_state_from_module` then finds them). Nothing is quantized for real: while the
model is built on the meta device, `Params4bit._quantize` runs bitsandbytes' meta kernels, which give
the packed weight and every state tensor its real shape (`meta_quantization`).

`gemm_4bit` (a 4-bit layer's forward) returns only its output; inside, the kernel dequantizes the
weight (in the activation's dtype) and the absmax, then multiplies. On the CPU that scratch is measured
like the other hidden kernels, and sized by rule for CUDA (scratch.py, `bnb_cuda_scratch`).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ckpt_tune.measure.fake import fake_mode

_STATE_FIELDS = ("absmax", "code", "offset")
_WEIGHT_ATTRS = ("quant_state", "blocksize", "compress_statistics", "quant_type", "quant_storage", "bnb_quantized")


def loaded() -> bool:
    """Whether bitsandbytes is imported (a model that uses it imported it; nothing here imports it)."""
    return "bitsandbytes" in sys.modules


def _state_parts(qs: Any) -> list[torch.Tensor]:
    parts = [getattr(qs, f, None) for f in _STATE_FIELDS]
    nested = getattr(qs, "state2", None)
    if nested is not None:
        parts += _state_parts(nested)
    return [t for t in parts if isinstance(t, torch.Tensor)]


def state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The quantization state tensors of the model's 4-bit weights (none without bitsandbytes)."""
    if not loaded():
        return []
    out: list[torch.Tensor] = []
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            out += _state_parts(qs)
    return out


@contextlib.contextmanager
def meta_quantization() -> Iterator[None]:
    """While open, quantizing a `Params4bit` whose data is on the meta device stays on the meta device:
    bitsandbytes' meta kernels size the packed weight and its state without any data. Only where
    bitsandbytes is imported when it opens (a target's module imports it before its build runs); a
    module moved to a device is quantized on the meta device either way (`quantize_on_meta`)."""
    patched = []
    if loaded():
        import bitsandbytes as bnb

        cls = bnb.nn.Params4bit
        real = cls._quantize

        def quantize(self, device):
            return real(self, torch.device("meta") if self.data.is_meta else device)

        cls._quantize = quantize
        patched.append((cls, real))
    try:
        with _no_meta_code_books():
            yield
    finally:
        for cls, real in patched:
            cls._quantize = real


@contextlib.contextmanager
def _no_meta_code_books() -> Iterator[None]:
    """bitsandbytes keeps the code book of nested quantization (`functional.name2qmap`) on the device of
    the first tensor it quantized: made on the meta device, a later real quantization in this process
    would fail on it ("Cannot copy out of meta tensor"). Code books made here on meta are dropped."""
    if not loaded():
        yield
        return
    import bitsandbytes.functional as bnb_f

    before = dict(bnb_f.name2qmap)
    try:
        yield
    finally:
        for name, code in list(bnb_f.name2qmap.items()):
            if isinstance(code, torch.Tensor) and code.is_meta:
                if name in before and not before[name].is_meta:
                    bnb_f.name2qmap[name] = before[name]
                else:
                    del bnb_f.name2qmap[name]


def quantize_on_meta(module: nn.Module) -> None:
    """Quantize, on the meta device, every 4-bit weight of `module` still waiting for its move to a
    device (what `module.to(device)` would have done; a fake build drops device moves)."""
    if not loaded():
        return
    import bitsandbytes as bnb

    with _no_meta_code_books():
        for p in module.parameters():
            if isinstance(p, bnb.nn.Params4bit) and not p.bnb_quantized and p.data.is_meta:
                p._quantize(torch.device("meta"))


def weight_states(model: nn.Module) -> dict[int, tuple[nn.Module, dict[str, Any]]]:
    """id(module) -> (module, the 4-bit weight's attributes), to carry over when the weight is replaced."""
    if not loaded():
        return {}
    return {
        id(mod): (mod, {a: getattr(w, a) for a in _WEIGHT_ATTRS if hasattr(w, a)})
        for mod in model.modules()
        if (w := getattr(mod, "weight", None)) is not None and getattr(w, "quant_state", None) is not None
    }


def _to_fake(t: torch.Tensor) -> torch.Tensor:
    mode = fake_mode()
    if t.is_meta:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return mode.from_tensor(t)


def _fake_state(qs: Any) -> Any:
    new = copy.copy(qs)
    for f in _STATE_FIELDS:
        t = getattr(qs, f, None)
        if isinstance(t, torch.Tensor):
            setattr(new, f, _to_fake(t))
    if getattr(qs, "state2", None) is not None:
        new.state2 = _fake_state(qs.state2)
    return new


def restore_weight_states(saved: dict[int, tuple[nn.Module, dict[str, Any]]]) -> None:
    """Set the saved attributes, with fake state tensors, on each module's (now fake) weight."""
    for mod, attrs in saved.values():
        w = mod.weight
        for a, v in attrs.items():
            setattr(w, a, _fake_state(v) if a == "quant_state" else v)
        mod.quant_state = w.quant_state


_FLOPS_REGISTERED = False


def register_flops() -> None:
    """Teach torch's FlopCounterMode the 4-bit matmul: `gemm_4bit` is 2·M·N·K like the `linear` it
    replaces (it has no formula of its own, so a 4-bit layer's forward would count as free and its
    recompute look cheap). Once per process, and only where bitsandbytes is loaded."""
    global _FLOPS_REGISTERED
    if _FLOPS_REGISTERED or not loaded():
        return
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.bitsandbytes.gemm_4bit)
    def _gemm_4bit_flops(a_shape, b_shape, shape_b, *args, out_shape=None, **kwargs) -> int:
        rows = 1
        for d in a_shape[:-1]:
            rows *= d
        return 2 * rows * int(shape_b[0]) * int(shape_b[1])

    _FLOPS_REGISTERED = True
