"""Ground truth for tests: an independent measurement of one training iteration's peak on CPU.

It shares no code with ckpt_tune's runner: the profiler is started before the warm-up iteration, so
every allocation and free after the model was built (gradients, optimizer state, the batch, activations)
is seen, and the measured iteration's peak is the bytes allocated before profiling (parameters and
buffers) plus the largest running sum of allocator events inside that iteration (docs/design.md §3).
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.utils.checkpoint as cp
from torch.profiler import ProfilerActivity, profile, record_function

MARK = "harness::measured"


def wrap_blocks(model, names):
    """A plain non-reentrant checkpoint wrapper, independent of ckpt_tune.apply; an entry that is a
    tuple of names (a plan's segment) runs those blocks as one checkpointed `RegionSegment`; an entry that
    is a dict `{"module": name, "policy": p}` (a plan's op-level entry in its data form) or its short
    form `"name@p"` checkpoints that module selectively (`policy_context`). A ckpt-tune plan entry is
    read for its data only: its `to_data()` form where it has one, else the names in its `modules`.
    A Hugging Face model gets `use_cache = False`, as its own gradient checkpointing sets it (a KV
    cache filled again by the recompute)."""
    if names:
        for m in model.modules():
            if getattr(getattr(m, "config", None), "use_cache", None) is True:
                m.config.use_cache = False
    for name in names:
        if hasattr(name, "to_data"):
            name = name.to_data()
        name = getattr(name, "modules", name)
        if isinstance(name, str) and "@" in name:
            module, _, policy = name.rpartition("@")
            name = {"module": module, "policy": policy}
        if isinstance(name, dict):
            _wrap_policy(model.get_submodule(name["module"]), name["policy"])
            continue
        if not isinstance(name, str) and len(name) == 1:
            name = name[0]
        if not isinstance(name, str):
            RegionSegment([model.get_submodule(n) for n in name]).install()
            continue
        mod = model.get_submodule(name)
        inner = mod.forward

        def fwd(*args, _inner=inner, _mod=mod, **kwargs):
            # containers copied at the call: a list the caller grows later (DenseNet) is recomputed as it was
            args, kwargs = torch.utils._pytree.tree_map(lambda x: x, (args, kwargs))
            calls = []

            def run(*a):
                calls.append(None)
                if len(calls) == 1:
                    return _inner(*a, **kwargs)
                undo = _running_stat_copies(_mod)
                try:
                    return _inner(*a, **kwargs)
                finally:
                    undo()

            return cp.checkpoint(run, *args, use_reentrant=False)

        mod.forward = fwd


def policy_context(policy: str):
    """`context_fn` for a selectively checkpointed module, the harness's own reading of an op policy.

    What the policy names is defined in ckpt_tune/plan/policy.py (its op sets): `matmuls` keeps the
    outputs of matrix products/convolutions and attention kernels, `half-matmuls` the same but every
    second matrix product (counted in call order, the forward and the recompute each from one) is
    recomputed, `attention` keeps the attention kernels' outputs only. Everything else is recomputed."""
    from ckpt_tune.plan.policy import ATTENTION_OPS, MATMUL_OPS, POLICIES

    if policy not in POLICIES:
        raise ValueError(f"unknown op policy {policy!r}")

    def make():
        count = {False: 0, True: 0}  # matrix products seen, in the forward and in the recompute

        def decide(ctx, op, *args, **kwargs):
            if op in ATTENTION_OPS:
                return cp.CheckpointPolicy.MUST_SAVE
            if op in MATMUL_OPS and policy != "attention":
                count[ctx.is_recompute] += 1
                if policy == "matmuls" or count[ctx.is_recompute] % 2 == 1:
                    return cp.CheckpointPolicy.MUST_SAVE
            return cp.CheckpointPolicy.PREFER_RECOMPUTE

        return cp.create_selective_checkpoint_contexts(decide)

    return make


def _wrap_policy(mod, policy: str) -> None:
    inner = mod.forward
    make = policy_context(policy)

    def fwd(*args, _inner=inner, **kwargs):
        # containers copied at the call, as for a whole module: a list the caller grows later (DenseNet)
        args, kwargs = torch.utils._pytree.tree_map(lambda x: x, (args, kwargs))
        return cp.checkpoint(_inner, *args, use_reentrant=False, context_fn=make, **kwargs)

    mod.forward = fwd


class Segment:
    """Blocks run back to back, under ONE non-reentrant checkpoint when `checkpointed` (public API only,
    independent of ckpt_tune/plan/segment.py): only the segment's input is kept.

    For chains `x = block(x, *rest, **kw)`: each block gets the previous block's hidden state plus the
    extra arguments the caller passed to the first (Hugging Face blocks take attention masks etc., the
    same for every layer). The first block runs the whole segment; the others hand its result on. The
    output has the form of the last block's output (a tensor, or a tuple whose first entry is the
    hidden state)."""

    def __init__(self, blocks, checkpointed: bool) -> None:
        self.blocks = blocks
        self.forwards = [b.forward for b in blocks]  # before rewiring
        self.checkpointed = checkpointed
        self.returns_tuple = False
        self.hidden = None  # weak reference: a strong one would keep it alive through backward

    def _run(self, x, *args, **kwargs):
        out = x
        for fwd in self.forwards:
            out = fwd(x, *args, **kwargs)
            x = out[0] if isinstance(out, tuple) else out
        return out

    def __call__(self, x, *args, **kwargs):
        if self.checkpointed and torch.is_grad_enabled():
            out = cp.checkpoint(self._run, x, *args, use_reentrant=False, **kwargs)
        else:
            out = self._run(x, *args, **kwargs)
        self.returns_tuple = isinstance(out, tuple)
        self.hidden = weakref.ref(out[0] if self.returns_tuple else out)
        return out

    def passthrough(self, x, *args, **kwargs):
        assert x is self.hidden(), "segment blocks must be called as a chain"
        return (x,) if self.returns_tuple else x

    def install(self) -> None:
        self.blocks[0].forward = self.__call__
        for b in self.blocks[1:]:
            b.forward = self.passthrough


def _running_stat_copies(module):
    """Put copies of every BatchNorm running statistic inside `module` in place; returns what undoes it.
    A recompute must not update them a second time (pytorch#96136); the copies are memory of the step."""
    held = [(m, k, b) for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)
            for k, b in m._buffers.items() if b is not None]
    for m, k, b in held:
        m._buffers[k] = b.clone()

    def undo():
        for m, k, b in held:
            m._buffers[k] = b

    return undo


class RegionSegment:
    """Blocks their parent calls one after another, checkpointed as ONE region from the first block's call
    to the last block's return (public API only: `torch.autograd.graph.saved_tensors_hooks`; independent of
    ckpt_tune/plan/segment.py).

    Whatever the parent does between the blocks runs as it would: it may hand a block any tensor, use a
    middle block's output itself (torchvision's IntermediateLayerGetter, Hugging Face's position bias) or
    return tuples. What the blocks' forwards save for backward is not kept: each saved tensor becomes a
    handle, and the first handle unpacked in backward replays the blocks' forwards, from the RNG state the
    region opened with, with the arguments they had, an argument that was an earlier block's output replaced
    by its replayed value. What the parent's code between the blocks saves is kept as it is. Arguments are
    held (containers copied at the call); BatchNorm's running statistics are updated on copies in the
    replay."""

    def __init__(self, blocks) -> None:
        self.blocks = list(blocks)
        self.forwards = [b.forward for b in self.blocks]  # before rewiring
        self.frame = None  # the region of the forward now running

    def install(self) -> None:
        for pos, block in enumerate(self.blocks):
            block.forward = lambda *a, _pos=pos, **k: self._call(_pos, a, k)

    def _call(self, pos: int, args, kwargs):
        fwd = self.forwards[pos]
        if pos == 0:
            in_backward = torch._C._current_autograd_node() is not None
            grad = torch.is_grad_enabled() and self.blocks[0].training and not in_backward
            self.frame = _Region(self.blocks, self.forwards) if grad else None
        frame = self.frame
        if frame is None or len(frame.calls) != pos:
            self.frame = None
            return fwd(*args, **kwargs)
        out = frame.call(pos, args, kwargs)
        if pos == len(self.blocks) - 1:
            self.frame = None
        return out


class _Region:
    """One forward's region of a `RegionSegment`."""

    def __init__(self, blocks, forwards) -> None:
        self.blocks, self.forwards = blocks, forwards
        self.rng = torch.get_rng_state()  # at the region's start
        # the autocast state at the region's start, restored for the replay (as torch.utils.checkpoint does)
        self.autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        self.calls: list = []  # (args, kwargs, RNG state if code between the blocks moved it)
        self.outputs: dict[int, tuple] = {}  # id(tensor) -> (weak reference, block, leaf)
        self.rng_after = None
        self.packed = 0
        self.replayed: dict[int, torch.Tensor] | None = None

    def call(self, pos: int, args, kwargs):
        def spec(x):
            if isinstance(x, torch.Tensor):
                hit = self.outputs.get(id(x))
                if hit is not None and hit[0]() is x:
                    return _Leaf(hit[1], hit[2])
            return x

        now = torch.get_rng_state()
        moved = pos > 0 and not torch.equal(now, self.rng_after)
        self.calls.append((*torch.utils._pytree.tree_map(spec, (args, kwargs)), now if moved else None))

        def pack(t):
            self.packed += 1
            return self, self.packed - 1

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack_region):
            out = self.forwards[pos](*args, **kwargs)
        for leaf, t in enumerate(torch.utils._pytree.tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor):
                self.outputs[id(t)] = (weakref.ref(t), pos, leaf)
        self.rng_after = torch.get_rng_state()
        if pos == len(self.forwards) - 1:
            self.outputs, self.rng_after = {}, None
        return out

    def replay(self) -> None:
        saved: list[torch.Tensor] = []
        outs: list[list] = []
        rng_now = torch.get_rng_state()
        torch.set_rng_state(self.rng)

        def keep(t):
            saved.append(t.detach())
            if len(saved) == self.packed:  # all there: stop, as torch.utils.checkpoint's early stop does
                raise _Replayed

        try:
            enabled, dtype = self.autocast
            with torch.enable_grad(), torch.autocast("cpu", dtype=dtype, enabled=enabled), \
                    torch.autograd.graph.saved_tensors_hooks(keep, lambda _: None):
                for block, fwd, (args, kwargs, rng) in zip(self.blocks, self.forwards, self.calls):
                    if rng is not None:
                        torch.set_rng_state(rng)
                    args, kwargs = torch.utils._pytree.tree_map(
                        lambda x: outs[x.block][x.leaf] if isinstance(x, _Leaf) else x, (args, kwargs))
                    undo = _running_stat_copies(block)
                    try:
                        outs.append(torch.utils._pytree.tree_flatten(fwd(*args, **kwargs))[0])
                    finally:
                        undo()
        except _Replayed:
            pass
        finally:
            torch.set_rng_state(rng_now)
        if len(saved) != self.packed:
            raise RuntimeError(f"region replay saved {len(saved)} tensors, the forward {self.packed}")
        self.replayed = dict(enumerate(saved))


class _Replayed(Exception):
    """Raised inside a replay once every saved tensor is there again."""


class _Leaf:
    """Leaf `leaf` of the output of the region's block `block`, in a recorded call."""

    __slots__ = ("block", "leaf")

    def __init__(self, block: int, leaf: int) -> None:
        self.block, self.leaf = block, leaf


def _unpack_region(handle) -> torch.Tensor:
    region, index = handle
    if region.replayed is None:
        region.replay()
    return region.replayed.pop(index)


def make_optimizer(params, name):
    """The optimizer `name` over `params` (None for "none"); `name` may also be a callable that builds
    one from the parameters (ZeroRedundancyOptimizer for a sharded step)."""
    if callable(name):
        return name(params)
    if name == "none" or not params:
        return None
    return {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-3),
        "adam": lambda: torch.optim.Adam(params, lr=1e-3),
        "sgd": lambda: torch.optim.SGD(params, lr=1e-3),
        "sgd-momentum": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    }[name]()


def measured_peak(
    build,
    make_batch,
    loss_fn,
    batch_size: int,
    checkpoint=(),
    optimizer: str = "adamw",
    accum_steps: int = 1,
    wrap=None,
    steps: int = 2,
    count_build: bool = False,
) -> int:
    """Peak live bytes of the steady-state iterations (2..steps) of a freshly built model.

    `checkpoint`: names (and segments) wrapped by `wrap_blocks`; `wrap`: any other rewrite of the
    fresh model. With `accum_steps` > 1 an iteration is that many micro-batches of `batch_size`
    (loss / steps, gradients summed by autograd) before the one optimizer step. `count_build`: the
    model's own bytes are what the allocator holds after `build()` (recorded under the profiler too),
    not its parameters and buffers: a quantized layer keeps state outside both."""
    built = None
    if count_build:
        gc.collect()
        gc.disable()
        try:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as build_prof:
                model = build()
        finally:
            gc.enable()
        built = sum(
            e.nbytes()
            for e in build_prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        )
        del build_prof
    else:
        model = build()
    model.train()
    if checkpoint:
        wrap_blocks(model, checkpoint)
    if wrap is not None:
        wrap(model)
    params = [p for p in model.parameters() if p.requires_grad]
    # a sharded (DTensor) parameter holds its local shard only
    local = [t.to_local() if hasattr(t, "to_local") else t for t in [*model.parameters(), *model.buffers()]]
    before = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}
    gc.collect()  # earlier tests' garbage must not be freed (and reported) while profiling
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            opt = make_optimizer(params, optimizer)
            for i in range(steps):
                if i == 1:
                    with record_function(MARK):
                        pass
                for p in params:
                    p.grad = None
                for _ in range(accum_steps):
                    loss = batch = None  # free the previous micro-batch's; the last one lives through the step
                    batch = make_batch(batch_size)
                    loss = loss_fn(model, batch)
                    if accum_steps > 1:
                        loss = loss / accum_steps
                    loss.backward()
                if opt is not None:
                    opt.step()
                del loss, batch
    finally:
        gc.enable()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() in ("[memory]", MARK)]
    events.sort(key=lambda e: e.start_ns())
    live, peak, started = 0, 0, False
    for e in events:
        if e.name() == MARK:
            started, peak = True, live
            continue
        if e.device_type() == torch.autograd.DeviceType.CPU:
            live += e.nbytes()
        if started:
            peak = max(peak, live)
    del prof, model, opt, params
    gc.collect()
    return (built if built is not None else sum(before.values())) + peak


def one_step(model, batch, loss_fn, seed: int = 1) -> dict:
    """One training forward+backward from a fixed seed: what a checkpoint plan must leave unchanged
    (loss, gradients, buffers such as BatchNorm statistics, the global RNG state afterwards)."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(model, batch)
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "rng": torch.get_rng_state(),
    }
