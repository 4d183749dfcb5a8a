"""The peers of ckpt-tune's op-level plans (issue 16), each as its authors define it, for benchmarks/ops.py.

- torchtitan's selective "op" activation checkpointing (`--activation_checkpoint.mode selective
  --activation_checkpoint.selective_ac_option op`): every transformer block wrapped with
  `checkpoint_wrapper` and a selective-checkpoint policy that saves the outputs of the ops on
  `_op_sac_save_list` except every second `aten.mm`. Reproduced from pytorch/torchtitan:
      torchtitan/distributed/activation_checkpoint.py @ cfb93265153094f99736547f26b5346410181102
          (`_apply_op_sac`, `_get_custom_policy`, `apply_ac`)
      torchtitan/models/llama3/infra/parallelize.py @ 018740b7aae7846d24954539244c78215dbd181f
          (`_op_sac_save_list`, passed to `apply_ac` by `parallelize_llama`)
  (the newest torchtitan replaces the every-second-mm counter by named tensors; the rule above is the
  one its Llama recipes ran with). The save list names the CUDA attention kernels only, and `aten.mm`
  only: on CPU, `scaled_dot_product_attention` runs `_scaled_dot_product_flash_attention_for_cpu`, and a
  Linear with a bias runs `aten.addmm`, neither on the list, so on biased models (GPT-2, ViT) the rule
  saves next to nothing and behaves like full checkpointing. That is the rule as written; it is not
  adapted here.
- Hugging Face `model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
  False})`: every decoder layer checkpointed whole. Applies to `transformers.PreTrainedModel`s that
  support it, and to nothing else.
- `torch.compile(model)` with `torch._functorch.config.activation_memory_budget = f` (the min-cut
  partitioner's knob: 1.0 its default plan, 0.0 the least activation memory it can reach), inductor on
  CPU. `compiled(...)` compiles a freshly built model under one fraction and runs one forward and
  backward (then drops the gradients) so that the compile, and the lazy compile of the backward,
  happen before the harness starts profiling: the harness calls `wrap(model)` before its profiler
  starts, and the compiled model keeps its own graphs afterwards (each `torch.compile` call has its own
  cache entries), so the same instance can be timed later.
"""

from __future__ import annotations

import time
import types
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch._functorch.config
from torch import nn

# -- torchtitan's selective op rule -------------------------------------------------------------------


def _lookup(path: str):
    """`torch.ops.aten.mm.default` etc. by dotted path; None where this torch lacks the op."""
    obj: Any = torch
    for part in path.split(".")[1:]:
        try:
            obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            return None
    return obj


# torchtitan/models/llama3/infra/parallelize.py @ 018740b, verbatim (entries this torch lacks skipped):
# "# for selective op activation checkpointing"
_OP_SAC_SAVE_LIST_NAMES = (
    "torch.ops.aten.mm.default",
    "torch.ops.aten._scaled_dot_product_efficient_attention.default",
    "torch.ops.aten._scaled_dot_product_flash_attention.default",
    "torch.ops.aten._scaled_dot_product_cudnn_attention.default",
    "torch.ops.aten._scaled_dot_product_attention_math.default",
    "torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default",
    "torch.ops._c10d_functional.reduce_scatter_tensor.default",
    # for low precision training, it's useful to always save
    # the result of max, since the absolute maximum is
    # used to compute the scaling factor for quantization.
    "torch.ops.aten.max.default",
    "torch._higher_order_ops.flex_attention",
    "torch.ops.torch_attn._varlen_attn.default",
    "torch._higher_order_ops.inductor_compiled_code",
)
_op_sac_save_list = {op for op in map(_lookup, _OP_SAC_SAVE_LIST_NAMES) if op is not None}
# torchtitan's ActivationCheckpointConfig default for per_op_sac_force_recompute_mm_shapes_by_fqns
FORCE_RECOMPUTE_FQNS = ("moe.router.gate",)


def _apply_op_sac(module: nn.Module, base_fqn: str | None, op_sac_save_list: set, preserve_rng_state: bool = True) -> nn.Module:
    """torchtitan's `_apply_op_sac` (activation_checkpoint.py @ cfb9326), with its config defaults
    (force-recompute FQNs ["moe.router.gate"], determinism_check "default", early_stop False, debug
    False). One change: `preserve_rng_state=True` (torchtitan's default is False, for models without
    dropout; GPT, GPT-2 and the ViT here have dropout, and without it the recompute would draw other
    masks). It saves no tensor and so changes no peak."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper as ptd_checkpoint_wrapper,
    )
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    mm_recompute_shapes = set()
    for module_fqn, submod in module.named_modules():
        fqn = module_fqn
        if base_fqn is not None:
            fqn = f"{base_fqn}.{module_fqn}"
        if not any(filter_fqn in fqn for filter_fqn in FORCE_RECOMPUTE_FQNS):
            continue
        if not isinstance(submod, nn.Linear):
            raise ValueError(f"per_op_sac_force_recompute_mm_shapes_by_fqns expected to match a nn.Linear, but got: {submod}")
        out_f, in_f = submod.weight.shape
        mm_recompute_shapes.add((in_f, out_f))

    def _get_custom_policy(meta):
        def _custom_policy(ctx, func, *args, **kwargs):
            if (
                func == torch.ops.aten._to_copy.default
                and "cuda" in str(args[0].device)
                and "device" in kwargs
                and str(kwargs["device"]) == "cpu"
            ):
                return CheckpointPolicy.MUST_SAVE

            mode = "recompute" if ctx.is_recompute else "forward"
            mm_count_key = f"{mode}_mm_count"
            if func == torch.ops.aten.mm.default:
                if args[1].shape in mm_recompute_shapes:
                    return CheckpointPolicy.PREFER_RECOMPUTE
                meta[mm_count_key] += 1
            # Saves output of all compute ops, except every second mm
            to_save = func in op_sac_save_list and not (func == torch.ops.aten.mm.default and meta[mm_count_key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

        return _custom_policy

    def selective_checkpointing_context_fn():
        meta = defaultdict(int)
        return create_selective_checkpoint_contexts(_get_custom_policy(meta))

    return ptd_checkpoint_wrapper(
        module,
        context_fn=selective_checkpointing_context_fn,
        preserve_rng_state=preserve_rng_state,
        determinism_check="default",
        early_stop=False,
        debug=False,
    )


def torchtitan_op_ac(blocks: Sequence[str]) -> Callable[[nn.Module], None]:
    """A `wrap` for the harness: torchtitan's op rule on every block (`apply_ac` wraps every child of
    `model.layers`; here the model's transformer blocks, by name), each block replaced in its parent
    by the wrapper, as `layers.register_module(layer_id, transformer_block)` does."""

    def wrap(model: nn.Module) -> None:
        for name in blocks:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            parent.register_module(child, _apply_op_sac(parent.get_submodule(child), name, _op_sac_save_list))

    return wrap


# -- Hugging Face's gradient checkpointing ------------------------------------------------------------


def hf_applies(model: nn.Module) -> str | None:
    """None if `gradient_checkpointing_enable` applies to `model`, else why not."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return "transformers is not installed"
    if not isinstance(model, PreTrainedModel):
        return f"not a Hugging Face model ({type(model).__name__}): gradient_checkpointing_enable does not apply"
    if not getattr(model, "supports_gradient_checkpointing", False):
        return f"{type(model).__name__} does not support gradient checkpointing"
    return None


def hf_gradient_checkpointing(model: nn.Module) -> None:
    """A `wrap` for the harness: HF's own switch, every layer, non-reentrant (as HF recommends)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# -- torch.compile with an activation memory budget ---------------------------------------------------


class Compiled:
    """`wrap`s for the harness that compile the fresh model under one `activation_memory_budget` and
    warm it up before profiling; the compiled instances are kept (`models[f]`) for timing."""

    def __init__(self, make_batch: Callable[[int], Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch_size: int) -> None:
        self.make_batch, self.loss_fn, self.batch_size = make_batch, loss_fn, batch_size
        self.models: dict[float, nn.Module] = {}
        self.compile_s: dict[float, float] = {}
        # several compiled instances of one class live at once: one cache entry each on its forward
        for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 256))

    def wrap(self, fraction: float) -> Callable[[nn.Module], None]:
        def wrap(model: nn.Module) -> None:
            t0 = time.perf_counter()
            with torch._functorch.config.patch(activation_memory_budget=fraction):
                # in place, as `model.compile()` does (names, parameters and the harness's view of the model
                # unchanged), but on a code object of its own: dynamo keeps compiled graphs per code object,
                # and `Module._call_impl` is shared by every module, so a second compiled instance of the
                # same class would run the first one's graph (its guards pass) whatever its fraction
                model._compiled_call_impl = torch.compile(_own_code(model, str(fraction).replace(".", "_")))
                loss = self.loss_fn(model, self.make_batch(self.batch_size))
                loss.backward()  # the backward graph is compiled lazily, on its first call
            del loss
            for p in model.parameters():
                p.grad = None
            self.compile_s[fraction] = round(time.perf_counter() - t0, 1)
            self.models[fraction] = model

        return wrap


def _own_code(model: nn.Module, tag: str) -> Callable:
    """`model._call_impl` (what `Module.compile` compiles) bound to a copy of its code object."""
    impl = nn.Module._call_impl
    code = impl.__code__.replace(co_name=f"_call_impl_{tag}")  # a new code object, same bytecode
    return types.MethodType(types.FunctionType(code, impl.__globals__, code.co_name, impl.__defaults__, impl.__closure__), model)


def compile_unavailable() -> str | None:
    """None if inductor can compile a small forward and backward on this CPU, else why not."""
    try:
        lin = nn.Linear(4, 4)
        fn = torch.compile(lambda x: lin(x).relu().sum())
        fn(torch.randn(2, 4)).backward()
        torch._dynamo.reset()
    except Exception as e:
        return f"torch.compile (inductor, CPU) failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None
