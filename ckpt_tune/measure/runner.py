"""Run one training iteration of docs/design.md §2 under instrumentation, and leave the model as it was.

    zero_grad(set_to_none=True) → make_batch → forward → loss → backward → optimizer.step()

`StepRunner` owns the optimizer (learning rate 0, so the step allocates exactly what a real step does
but leaves every parameter bit-for-bit unchanged), the autocast/precision set-up, and the snapshot that
restores the model afterwards (train/eval mode, buffers, dtypes, RNG). `measure()` records the
allocator's events of one steady-state iteration (optimizer state already allocated); `time_step()` times
one without the profiler.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_map_only

from ckpt_tune import vocab
from ckpt_tune.errors import UserCodeError
from ckpt_tune.measure import fake, fake_inputs, quantized
from ckpt_tune.measure.instrument import ForwardClock, Instrument
from ckpt_tune.measure.tensors import local_tensor, unique_bytes
from ckpt_tune.measure.timeline import Recorder, Timeline, mark
from ckpt_tune.measure.timing import Timing, iteration_flops
from ckpt_tune.plan import apply as plan_apply
from ckpt_tune.plan.entry import Entry, entries_of

SEED = 0


@dataclass(frozen=True)
class StepSettings(vocab.RunSpec):
    """How a runner steps (vocab.RunSpec; its batch size is each step's own)."""

    fake_target: str = "cuda"  # device "meta": the allocator the fake timeline mimics ("cuda" or "cpu")


@dataclass
class Measurement:
    """One recorded iteration. Bytes are absolute device bytes unless named `*_delta`."""

    batch_size: int
    checkpoint: tuple[Entry, ...]
    param_bytes: int  # parameters + buffers (distinct storages)
    optimizer_bytes: int  # optimizer state tensors
    grad_bytes: int  # gradients at the end of the iteration
    static_bytes: int  # live when recording started: params + buffers + optimizer state (grads freed)
    peak_bytes: int
    peak_time: int
    timeline: Timeline
    saved: dict[int, tuple[int, str | None]] = field(default_factory=dict)  # ptr -> (bytes, innermost module; None: outside the model)
    grad_ptrs: list[int] = field(default_factory=list)
    module_io: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (input, output bytes)
    reserved_bytes: int | None = None  # CUDA: max_memory_reserved() of the iteration
    # marked modules whose first tensor argument was the output of the marked module that ran before
    # them: blocks called as a chain (`x = block(x, ...)`), which a segment can span
    chained: frozenset[str] = frozenset()

    def rel(self, t: int) -> int:
        return self.timeline.live_at(t)


class StepRunner:
    """A model set up for training iterations. Use as a context manager; on exit the model is restored."""

    def __init__(
        self, model: nn.Module, batch_fn: Callable[[int], Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor], settings: StepSettings = StepSettings()
    ) -> None:
        self.model, self.batch_fn, self.loss_fn, self.settings = model, batch_fn, loss_fn, settings
        self.fake = settings.device == "meta"  # fake tensors: the CPU-device graph, nothing allocated
        self.device = torch.device("cpu" if self.fake else settings.device)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler = None
        self._warm = False
        self.iterations = 0  # training iterations run (`iteration`)
        self.real_peaks: list[int] = []  # peaks of the steps `measure` recorded for real (not under fake tensors)
        self._snapshot: dict[str, Any] = {}
        self._froze = False  # whether __enter__ froze the collector's objects (gc.freeze)
        self.notes: list[str] = []  # how steps were measured, when not as asked (see measure/host.py)

    # -- set-up and restoration ---------------------------------------------------------------
    def _ctx(self):
        return fake.running() if self.fake else contextlib.nullcontext()

    def __enter__(self) -> StepRunner:
        with self._ctx():
            return self._enter()

    def _enter(self) -> StepRunner:
        m = self.model
        # LayerDrop (Hugging Face's `layerdrop`: a layer skipped at random in training) makes each step's
        # memory depend on the random stream; every layer runs while measuring: the step's worst case. A
        # module holds its rate (BART's encoder), or its Hugging Face config does, read at each call (Wav2Vec2's)
        holders = {id(h): h for mod in m.modules() for h in (mod, getattr(mod, "config", None)) if isinstance(h, nn.Module) or hasattr(h, "to_dict")}
        dropping = [(h, h.layerdrop) for h in holders.values() if _layerdrop(h) > 0]
        for holder, _ in dropping:
            holder.layerdrop = 0.0
        if dropping:
            n, p = len(dropping), max(p for _, p in dropping)
            self.notes.append(f"LayerDrop off while measuring ({n} setting{'s' * (n > 1)} skipping layers at random, p = {p:g}): every layer runs, the step's worst case")
        self._snapshot = {
            "layerdrop": dropping,
            "modes": {mod: mod.training for mod in m.modules()},
            # buffers by slot: a dtype change replaces the tensor object in the module's _buffers
            "buffers": [(mod, k, b, b.detach().clone()) for mod in m.modules() for k, b in mod._buffers.items() if b is not None],
            "data": [(p, p.data) for p in m.parameters()],
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "grads": [(p, p.grad) for p in m.parameters()],
        }
        if self.settings.precision == "bf16":
            fake_inputs.to_dtype(m, torch.bfloat16) if self.fake else m.to(torch.bfloat16)
        m.train()
        params = [p for p in m.parameters() if p.requires_grad]
        # CUDA's optimizers default to foreach (one temporary per parameter, all at once); fake tensors
        # are CPU tensors, whose default is the per-parameter loop: ask for what the target would run
        foreach = True if self.fake and self.settings.fake_target == "cuda" else None
        # made outside the fake mode: bitsandbytes' 8-bit optimizers compute their quantization maps
        # from Python numbers on real tensors when constructed (a 1 KiB table; the states come later)
        with unset_fake_temporarily() if self.fake else contextlib.nullcontext():
            self.optimizer = vocab.optimizer(self.settings.optimizer).make(params, foreach)
        if self.settings.precision == "fp16-mixed" and not self.fake:  # found_inf.item() is data-dependent
            self.scaler = torch.amp.GradScaler(self.device.type)
        # Each recorded step collects garbage first (timeline.Recorder). One full collection here, then
        # the collector leaves what lives now (the model, its states, torch's own objects) alone, and those
        # collections scan only what the steps create (a full one took 0.13 s per step of the bundled
        # GPT's search). Not where an outer runner or caller froze already: its unfreeze is its own. Under
        # fake tensors garbage holds no memory and is frozen with the rest (the collection took 0.28 s
        # after a 7B's imports and build); it is collected once unfrozen
        self._froze = gc.get_freeze_count() == 0
        if self._froze:
            if not self.fake:
                gc.collect()
            gc.freeze()
        return self

    def __exit__(self, *exc) -> None:
        with self._ctx():
            self._exit()

    def _exit(self) -> None:
        if self._froze:
            gc.unfreeze()
            self._froze = False
        snap, _m = self._snapshot, self.model
        for mod, p in snap["layerdrop"]:
            mod.layerdrop = p
        self.optimizer = None
        for p, g in snap["grads"]:
            p.grad = g
        for t, data in snap["data"]:
            t.data = data
        with torch.no_grad():
            for mod, k, b, saved in snap["buffers"]:
                mod._buffers[k] = b
                b.copy_(saved)
        for mod, training in snap["modes"].items():
            mod.training = training
        torch.set_rng_state(snap["rng"])
        if snap["cuda_rng"] is not None:
            torch.cuda.set_rng_state_all(snap["cuda_rng"])

    # -- one iteration --------------------------------------------------------------------------
    def _autocast(self):
        p = self.settings.precision
        if p in ("bf16-mixed", "fp16-mixed"):
            dtype = torch.bfloat16 if p == "bf16-mixed" else torch.float16
            return torch.autocast(self.device.type, dtype=dtype)
        return contextlib.nullcontext()

    def _zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def iteration(
        self, batch_size: int, accum_steps: int = 1, optimizer_step: bool = True, after_forward: Callable[[], None] | None = None
    ) -> None:
        """One training iteration, with phase markers (harmless when nothing records). With
        `accum_steps` > 1: that many micro-batches (loss / steps, gradients summed by autograd) before
        the one optimizer step; from the second on, every gradient is live through forward and backward.
        `optimizer_step=False`: forward and backward only (the "step" marker still closes the iteration).
        `after_forward`: called once each micro-batch's loss exists, before its backward."""
        torch.manual_seed(SEED)  # same dropout masks every time: memory is deterministic
        self.iterations += 1  # recorded, timed or warm-up
        self._zero_grad()
        mark("iter")
        for micro in range(accum_steps):
            if micro:
                mark("micro")
            batch = loss = None  # the previous micro-batch's are freed before the next is made
            batch = self.batch_fn(batch_size)
            if self.settings.precision == "bf16":
                batch = _cast_floating(batch, torch.bfloat16)
            mark("batch")
            with self._autocast():
                loss = self.loss_fn(self.model, batch)
                if accum_steps > 1:
                    loss = loss / accum_steps
            mark("loss")
            if after_forward is not None:
                after_forward()
            try:
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            except RuntimeError as e:
                raise UserCodeError(
                    f"backward failed: {type(e).__name__}: {str(e).splitlines()[0]}",
                    "check that the loss depends on the model's trainable parameters",
                ) from e
            mark("backward")
        if self.optimizer is not None and optimizer_step:
            with self._optimizer_step():
                if self.scaler is not None:
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                else:
                    self.optimizer.step()
        mark("step")

    def _optimizer_step(self) -> contextlib.AbstractContextManager:
        """The context the optimizer step runs in (a sharded runner's: measure/sharded.py)."""
        return contextlib.nullcontext()

    def warm_up(self, batch_size: int) -> None:
        """Run one iteration so the optimizer state exists (steady state)."""
        if not self._warm:
            with self._ctx():
                self.iteration(batch_size)
            self._warm = True

    def state_bytes(self) -> tuple[int, int, int]:
        """(parameters + buffers + 4-bit weights' quantization state, optimizer state, gradients) bytes,
        distinct storages."""
        m = self.model
        param = unique_bytes([*m.parameters(), *m.buffers(), *quantized.state_tensors(m)])
        opt = unique_bytes(self.optimizer_state())
        grads = unique_bytes(p.grad for p in m.parameters() if p.grad is not None)
        return param, opt, grads

    def optimizer_state(self) -> list[torch.Tensor]:
        """The optimizer state's tensors (none before the first step)."""
        opt = self.optimizer
        return [] if opt is None else [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]

    def _steady(self, tl: Timeline) -> Timeline | None:
        """A first iteration's timeline as a steady-state one would be: without the optimizer state the
        step allocated (which a later iteration finds in place). None when the iteration keeps more than
        its gradients and that state: something made on the first call stays (a cache, a lazily built
        buffer), and the steady state is only reached after it (docs/design.md §3)."""
        held = tl.held_at_end()
        state = {fake.fake_storage_key(local_tensor(t)) for t in self.optimizer_state()}
        grads = {fake.fake_storage_key(local_tensor(p.grad)) for p in self.model.parameters() if p.grad is not None}
        if set(held) - state - grads:
            return None
        return tl.without({k for p, k in held.items() if p in state})

    # -- measurement ----------------------------------------------------------------------------
    def measure(
        self,
        batch_size: int,
        checkpoint: Sequence = (),
        units: Sequence[str] = (),
        attribute: bool = False,
        accum_steps: int = 1,
        optimizer_step: bool = True,
        cold: bool = False,
    ) -> Measurement:
        """Record one steady-state iteration.

        `checkpoint`: module names wrapped with non-reentrant checkpoint for this run. `units`: modules
        whose forward start/end and backward start are marked ("f>name", "f<name", "b>name"; the first
        micro-batch's come first). `attribute`: also attribute saved tensors to modules and mark every
        module. `accum_steps`: micro-batches per optimizer step (see `iteration`). `optimizer_step=False`:
        the optimizer step is left out of the recorded iteration (its moments are read from another one).

        Under fake tensors the first iteration is recorded as the steady one, without a warm-up before
        it: its optimizer step's allocation of the state is taken out of the timeline (`_steady`), or,
        where the iteration keeps anything else, it was the warm-up and the next one is recorded. `cold`:
        the same on a CPU (not CUDA, whose peak, the allocator's, holds the state's allocation).
        """
        cold = (self.fake or (cold and self.device.type == "cpu")) and not self._warm and optimizer_step and self.optimizer is not None
        if not cold:
            self.warm_up(batch_size)
        param_b, opt_b, grads_before = self.state_bytes()
        self._zero_grad()  # frees before recording starts: the profiler cannot see frees of older blocks
        names = {mod: name for name, mod in self.model.named_modules()}
        marked = set(units) | (set(names.values()) if attribute else set())
        inst = Instrument(self.model, names, marked, attribute)
        try:
            if checkpoint:
                plan_apply.apply(self.model, list(checkpoint))
            inst.install()
            cuda = self.device.type == "cuda"
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            recorder = fake.FakeRecorder(self.settings.fake_target) if self.fake else Recorder(self.device.type)
            with self._ctx(), recorder as rec:
                self.iteration(batch_size, accum_steps, optimizer_step)
            if cuda:
                torch.cuda.synchronize()
                cuda_peak, cuda_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        finally:
            inst.remove()
            if checkpoint:
                plan_apply.remove(self.model)
        tl = rec.timeline
        if cold:
            self._warm = True
            tl = self._steady(tl)
            if tl is None:
                return self.measure(batch_size, checkpoint, units, attribute, accum_steps, optimizer_step)
        param_b, opt_b, grads_after = self.state_bytes()
        static = param_b + opt_b
        t_start = tl.marker("iter")
        top, when = tl.max_between(t_start)
        peak, peak_time = static + top, when
        if static + grads_before > peak:  # the previous iteration's gradients, before zero_grad
            peak, peak_time = static + grads_before, t_start
        reserved = None
        if cuda:  # on CUDA the allocator's own counter is ground truth (it includes its 512 B rounding)
            peak, reserved = max(cuda_peak, static + grads_before), cuda_reserved
        if not self.fake:
            self.real_peaks.append(peak)
        return Measurement(
            batch_size=batch_size,
            checkpoint=entries_of(checkpoint),
            param_bytes=param_b,
            optimizer_bytes=opt_b,
            grad_bytes=grads_after,
            static_bytes=static,
            peak_bytes=peak,
            peak_time=peak_time,
            timeline=tl,
            saved=inst.saved,
            grad_ptrs=inst.grad_ptrs,
            module_io=inst.module_io,
            reserved_bytes=reserved,
            chained=frozenset(inst.chained),
        )

    def time_step(self, batch_size: int, checkpoint: Sequence = (), repeats: int = 3) -> Timing:
        """Median wall time of `repeats` iterations and each module's forward time (ms), no profiler."""
        self.warm_up(batch_size)
        if self.fake:
            return self._count_flops(batch_size, checkpoint)
        names = {mod: name for name, mod in self.model.named_modules()}
        clock = ForwardClock(self.model, names)
        steps: list[float] = []
        try:
            if checkpoint:
                plan_apply.apply(self.model, list(checkpoint))
            clock.install()
            for _ in range(repeats):
                clock.reset()
                sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
                sync()
                t0 = time.perf_counter()
                self.iteration(batch_size)
                sync()
                steps.append((time.perf_counter() - t0) * 1e3)
                clock.keep_min()
        finally:
            clock.remove()
            if checkpoint:
                plan_apply.remove(self.model)
        steps.sort()
        return Timing(batch_size, entries_of(checkpoint), steps[len(steps) // 2], dict(clock.best))

    def _count_flops(self, batch_size: int, checkpoint: Sequence) -> Timing:
        """Under fake tensors wall time means nothing: count FLOPs instead (1 GFLOP reported as 1 "ms").

        Recompute cost is then forward FLOPs of the checkpointed modules over the step's FLOPs, which is
        what their time ratio is on a GPU that runs both at the same throughput.
        """
        forward, step = self.count_flops(batch_size)
        return Timing(batch_size, entries_of(checkpoint), max(step[None], 1e-9), forward, unit="GFLOP")

    def count_flops(self, batch_size: int) -> tuple[dict[str, float], dict[str | None, float]]:
        """GFLOP per module of one forward, and of one whole iteration (`timing.iteration_flops`)."""
        with self._ctx():
            return iteration_flops(self.model, lambda after_forward: self.iteration(batch_size, after_forward=after_forward))


def _cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Pure-bf16 training feeds bf16 inputs: cast every floating tensor of the batch (any pytree)."""
    return tree_map_only(torch.Tensor, lambda x: x.to(dtype) if x.is_floating_point() else x, obj)


def _layerdrop(holder: Any) -> float:
    p = getattr(holder, "__dict__", {}).get("layerdrop")
    return float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) else 0.0
