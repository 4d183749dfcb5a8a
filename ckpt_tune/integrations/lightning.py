"""`CheckpointTuner`: a Lightning callback that plans gradient checkpointing and the batch size at fit start.

In the manner of Lightning's `BatchSizeFinder`: added to a `Trainer`, it searches when `fit` starts, with
the LightningModule's own `training_step` as the loss and batches collated from the train dataloader's
samples, on the trainer's device, precision and optimizer. Then it applies the plan to the module, writes
the micro-batch to the module's or datamodule's `batch_size` (`lightning_setattr`, as BatchSizeFinder
does), the accumulation to `trainer.accumulate_grad_batches`, rebuilds the train dataloader and logs the
plan (python `logging`).

    from lightning.pytorch import Trainer
    from ckpt_tune.integrations.lightning import CheckpointTuner

    tuner = CheckpointTuner(vram="24GB")
    Trainer(callbacks=[tuner]).fit(model)      # model.batch_size is set to what fits
    tuner.plan                                 # the plan applied

The search runs on a deep copy of the module (`_Source.build`): the user's module is changed only once
the plan is found, and is left as it was when the search or the set-up fails. Importing this module
imports Lightning.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import itertools
import logging
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils.data import DataLoader, IterableDataset

from ckpt_tune import vocab
from ckpt_tune.errors import CkptTuneError
from ckpt_tune.measure.loader import Target
from ckpt_tune.measure.session import Settings
from ckpt_tune.plan.apply import applied_names, apply, remove
from ckpt_tune.plan.file import Plan, write_plan
from ckpt_tune.plan.kinds import parse_candidates
from ckpt_tune.tune.search import SearchOutcome, search
from ckpt_tune.units import format_bytes, format_percent

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    from lightning.pytorch.tuner.batch_size_scaling import _reset_dataloaders
    from lightning.pytorch.utilities.parsing import (
        _lightning_get_all_attr_holders,
        lightning_hasattr,
        lightning_setattr,
    )
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
except ImportError as e:  # pragma: no cover - the lightning extra is installed in the test set-up
    raise CkptTuneError(
        f"ckpt_tune.integrations.lightning needs the lightning package ({e})", "pip install 'ckpt-tune[lightning]'"
    ) from e

log = logging.getLogger(__name__)

# Trainer(precision=...) as `trainer.precision` reports it -> the ckpt-tune precision it runs (vocab.PRECISIONS)
PRECISION_OF_TRAINER = {"32-true": "fp32", "bf16-mixed": "bf16-mixed", "16-mixed": "fp16-mixed", "bf16-true": "bf16"}


class CheckpointTuner(pl.Callback):
    """Find the largest batch that fits `vram` and the cheapest checkpoint plan there when `fit` starts,
    and train with them.

    Args:
        vram: the memory budget per device, as `ckpt-tune search --vram` reads it ("24GB", "600MiB", a
            number of bytes, "auto" on CUDA).
        margin: held back from the budget on CUDA (`--margin`: "5%", 0.05 or a size; None: 5%).
        device: where the step is measured (`--device`); None: the trainer's device.
        precision: a ckpt-tune precision (vocab.PRECISIONS); None: the trainer's (PRECISION_OF_TRAINER).
        optimizer: a ckpt-tune optimizer (vocab.OPTIMIZERS); None: the one `configure_optimizers` made,
            when ckpt-tune knows it.
        candidates: the kinds of plan choice ("blocks,segments", or their words; None: all).
        segments: also consider runs of consecutive blocks under one checkpoint.
        batch_size: a fixed micro-batch: only the cheapest plan at it is searched.
        target_batch: the effective batch per optimizer step: planned as micro-batch × accumulation.
        batch_arg_name: the attribute that holds the batch size, on the module, its `hparams` or the
            datamodule (as BatchSizeFinder looks it up).
        out: where to write the plan file (None: not written).

    After `fit` has started, `outcome` holds the search's `SearchOutcome` and `plan` its `Plan`.

    Raises (from `trainer.fit`):
        CkptTuneError: a set-up the callback cannot plan for (no `batch_size` attribute, a distributed
            strategy, dataloaders passed to `fit` directly, manual optimization, a precision or
            optimizer ckpt-tune does not run, ...), each with a hint.
        UserCodeError: `training_step` or the dataset raised, or the step's loss is not a trainable scalar
            (the message names the user's file and line).
        NoFitError: nothing fits the budget, at any batch (exit code 3 on the command line).
    """

    def __init__(
        self,
        vram: str | int,
        margin: str | float | None = None,
        device: str | None = None,
        precision: str | None = None,
        optimizer: str | None = None,
        candidates: str | Iterable[str] | None = None,
        segments: bool = True,
        batch_size: int | None = None,
        target_batch: int | None = None,
        batch_arg_name: str = "batch_size",
        out: str | Path | None = None,
    ) -> None:
        self.vram = str(vram)
        self.margin = margin
        self.device = device
        self.precision = None if precision is None else vocab.known("precision", precision, vocab.PRECISIONS)
        self.optimizer = None if optimizer is None else vocab.optimizer(optimizer).name
        joined = candidates if candidates is None or isinstance(candidates, str) else ",".join(candidates)
        self.candidates = None if joined is None else parse_candidates(joined)
        self.segments = segments
        self.batch_size = batch_size
        self.target_batch = target_batch
        self.batch_arg_name = batch_arg_name
        self.out = out
        self.outcome: SearchOutcome | None = None
        self._planned: weakref.ref | None = None  # the module this callback applied its plan to

    @property
    def plan(self) -> Plan | None:
        """The plan found and applied (None before `fit` started)."""
        return getattr(self.outcome, "plan", None)

    # -- the callback's hooks ------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str | None = None) -> None:
        """Refuse, before anything runs, a fit this callback cannot plan for."""
        if stage != "fit" or self._applied_to(pl_module):
            return
        if trainer._accelerator_connector.is_distributed:
            _refuse("CheckpointTuner plans one device; this Trainer runs a distributed strategy",
                    "plan a sharded run with `ckpt-tune search --world-size N --shard ...` and apply its plan file")
        if not trainer.fit_loop._data_source.is_module():
            _refuse("CheckpointTuner cannot change the batch size of dataloaders passed to fit() directly",
                    f"return the DataLoader from train_dataloader() of the LightningModule or a LightningDataModule, "
                    f"built with batch_size=self.{self.batch_arg_name}")
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            _refuse(f"no {self.batch_arg_name!r} attribute to write the batch size to: looked in the model, "
                    "its hparams and the datamodule",
                    f"set self.{self.batch_arg_name} in __init__ of the LightningModule or datamodule and build the "
                    f"train DataLoader with batch_size=self.{self.batch_arg_name}, or pass batch_arg_name=")
        if not pl_module.automatic_optimization:
            _refuse("CheckpointTuner needs automatic optimization: with manual optimization training_step runs "
                    "its own backward and optimizer step, so it is not a loss the search can run",
                    "plan with `ckpt-tune search` on a target whose loss_fn returns the loss")
        if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
            _refuse("training_step takes dataloader_iter: the search cannot hand it a batch of its own size",
                    "take `batch` (and `batch_idx`) in training_step")
        if self.target_batch is None and trainer.accumulate_grad_batches != 1:
            _refuse(f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) without target_batch: "
                    "a micro-batch planned alone would not fit with gradients kept across micro-batches",
                    "pass CheckpointTuner(target_batch=EFFECTIVE_BATCH): it plans micro-batch × accumulation")
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            _refuse("a GradientAccumulationScheduler changes the accumulation per epoch; the plan holds for one",
                    "remove it and pass CheckpointTuner(target_batch=...) instead")
        if applied_names(pl_module):
            _refuse(f"the module already has checkpointed modules ({', '.join(applied_names(pl_module)[:3])})",
                    "call ckpt_tune.remove(model) first, or drop CheckpointTuner and apply your plan yourself")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Search, then train with the plan: applied to the module, its batch and accumulation written."""
        if self._applied_to(pl_module):  # a later fit of the same module: its plan, without a search
            self._train_with(trainer, pl_module, self.outcome.plan)
            log.info("ckpt-tune: training %s with the plan found before: batch %d", type(pl_module).__name__,
                     self.outcome.plan.batch_size)
            return
        if trainer.fast_dev_run:
            log.info("ckpt-tune: fast_dev_run is on: no search")
            return
        source = _Source(trainer, pl_module, self.batch_arg_name)
        settings = Settings(
            device=self.device or str(trainer.strategy.root_device),
            precision=self.precision or _precision(trainer),
            optimizer=self.optimizer or _optimizer(trainer),
        )
        with _off_cuda(pl_module):
            # every step real: a fake copy of the model would be one more deep copy of the user's module
            # in host memory while it is made (the module is built by copying it, not from code)
            outcome = search(
                source.target(), self.vram, batch_size=self.batch_size, target_batch=self.target_batch,
                margin=self.margin, settings=settings, segments=self.segments, candidates=self.candidates,
                fake_probes=False,
            )
        if self.out is not None:
            log.info("ckpt-tune: plan written to %s", write_plan(outcome.plan, self.out))
        self._train_with(trainer, pl_module, outcome.plan)
        self.outcome = outcome
        self._planned = weakref.ref(pl_module)
        _log_outcome(outcome)

    # -- applying the plan ---------------------------------------------------------------------------
    def _applied_to(self, pl_module: pl.LightningModule) -> bool:
        """Whether this callback's plan is on `pl_module` already (a second `fit` of the same module)."""
        return self._planned is not None and self._planned() is pl_module

    def _train_with(self, trainer: pl.Trainer, pl_module: pl.LightningModule, plan: Plan) -> None:
        """Apply `plan` to the module (if it is not on it already), write its batch and accumulation and
        rebuild the dataloaders; on failure the module, the batch attribute and the trainer are left as
        they were."""
        name = self.batch_arg_name
        held = [(h, h[name] if isinstance(h, dict) else getattr(h, name)) for h in _lightning_get_all_attr_holders(pl_module, name)]
        old_accum = trainer.accumulate_grad_batches
        loop = trainer.fit_loop
        fresh = not applied_names(pl_module)
        try:
            apply(pl_module, plan)
            lightning_setattr(pl_module, name, plan.batch_size)
            trainer.accumulate_grad_batches = plan.grad_accum_steps
            _reset_dataloaders(trainer)  # BatchSizeFinder's: the loaders are built again at the new batch
            got = _train_loader(trainer).batch_size
            if got != plan.batch_size:
                _refuse(f"the train DataLoader was rebuilt with batch_size={got} after {name} was set to "
                        f"{plan.batch_size}: train_dataloader() does not read it",
                        f"build the train DataLoader with batch_size=self.{name}")
        except BaseException:
            if fresh:
                remove(pl_module)
            for holder, value in held:
                if isinstance(holder, dict):
                    holder[name] = value
                else:
                    setattr(holder, name, value)
            trainer.accumulate_grad_batches = old_accum
            loop._combined_loader = None  # built again, at the old batch, by the next fit
            raise


class _Source:
    """The search's target made of a LightningModule: a deep copy as the model, `training_step` as the
    loss, batches of any size collated from the train dataloader's samples."""

    def __init__(self, trainer: pl.Trainer, module: pl.LightningModule, batch_arg_name: str) -> None:
        self.trainer, self.module = trainer, module
        loader = _train_loader(trainer)
        if loader.batch_size is None:
            _refuse("the train DataLoader has no batch_size (a batch_sampler, or batch_size=None): the search "
                    "cannot make batches of another size from it",
                    f"build it with DataLoader(dataset, batch_size=self.{batch_arg_name}, ...)")
        self.dataset, self.collate = loader.dataset, loader.collate_fn
        self.samples: list[Any] = []  # the dataset's first samples, fetched once
        self.exhausted = False  # an iterable dataset: every sample it yields is in `samples`
        self.iterable = isinstance(self.dataset, IterableDataset)
        self.size = None if self.iterable else len(self.dataset)
        if self.size == 0:
            _refuse("the train dataset is empty", "check train_dataloader()")
        self.takes_idx = is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2)

    def target(self) -> Target:
        cls = type(self.module)
        where = f"{cls.__module__}.{cls.__qualname__}"
        return Target(
            spec=f"lightning:{where}",
            module_name=cls.__module__,
            file_path=_source_file(cls),  # an error in the user's code names its file and line
            fn_name=cls.__qualname__,
            build_fn=self.build,
            batch_fn=self.batch,
            loss_fn=self.loss,
            batch_source=f"{where}'s train dataloader (collate_fn over its samples)",
            loss_source=f"{where}.training_step",
        )

    def build(self) -> pl.LightningModule:
        """A deep copy of the module, attached to the trainer, with `log`/`log_dict` that do nothing: the
        search's steps are not training steps and log nothing."""
        model = copy.deepcopy(self.module)  # LightningModule.__getstate__ leaves the trainer out
        model.trainer = self.trainer
        model.log = model.log_dict = _no_log
        return model

    def batch(self, n: int) -> Any:
        """`n` samples collated as the train dataloader does: the dataset's first ones, repeated from the
        start when it holds fewer."""
        # the samples are kept real whatever mode the batch is made under: a search records its probes
        # under fake tensors, and a fake sample kept here would reach its real steps
        with unset_fake_temporarily():
            if self.iterable:
                self._draw(n)
            else:
                while len(self.samples) < min(n, self.size):
                    self.samples.append(self.dataset[len(self.samples)])
        picks = [self.samples[i % (len(self.samples) if self.iterable else self.size)] for i in range(n)]
        return self.collate(picks)

    def _draw(self, n: int) -> None:
        """An iterable dataset's first `n` samples (all it yields, if fewer) into `samples`."""
        if len(self.samples) < n and not self.exhausted:
            self.samples = list(itertools.islice(iter(self.dataset), n))
            self.exhausted = len(self.samples) < n
        if not self.samples:
            _refuse("the train dataset yields no sample", "check train_dataloader()")

    def loss(self, model: pl.LightningModule, batch: Any) -> Any:
        """`training_step`'s loss: what it returns, or its "loss" when it returns a mapping."""
        out = model.training_step(batch, 0) if self.takes_idx else model.training_step(batch)
        return out["loss"] if isinstance(out, Mapping) and "loss" in out else out


def _source_file(cls: type) -> Path | None:
    try:
        return Path(inspect.getfile(cls)).resolve()
    except (TypeError, OSError):  # a class defined where no file holds it (an interactive session)
        return None


@contextlib.contextmanager
def _off_cuda(module: pl.LightningModule) -> Iterator[None]:
    """While the search runs, a module on a CUDA device is held on the CPU: a CUDA step's peak is what the
    whole process has allocated (docs/design.md §2), which the module itself would add to. Its parameters
    stay the same objects (`Module.to` sets `.data`), so the optimizers Lightning made keep them; the
    search's copy is collected before the module goes back."""
    home = next((t.device for t in (*module.parameters(), *module.buffers()) if t.device.type == "cuda"), None)
    if home is not None:
        module.to("cpu")
    try:
        yield
    finally:
        gc.collect()  # the search's copy of the module, and what its steps left, before training starts
        if home is not None:
            torch.cuda.empty_cache()
            module.to(home)


def _no_log(*_args: Any, **_kwargs: Any) -> None:
    return None


def _refuse(message: str, hint: str) -> NoReturn:
    raise CkptTuneError(message, hint)


def _train_loader(trainer: pl.Trainer) -> DataLoader:
    """The fit loop's one train DataLoader, set up as training sees it."""
    loop = trainer.fit_loop
    loop.setup_data()
    combined = loop._combined_loader
    if combined is None:
        _refuse("the Trainer has no train dataloader to plan for (limit_train_batches=0, or no training_step)",
                "CheckpointTuner plans training: give the fit a train dataloader")
    loaders = combined.flattened
    if len(loaders) != 1 or not isinstance(loaders[0], DataLoader):
        _refuse(f"CheckpointTuner plans one train DataLoader; this fit has {len(loaders)} train iterables",
                "plan with `ckpt-tune search` on a target that makes the combined batch")
    return loaders[0]


def _precision(trainer: pl.Trainer) -> str:
    """The ckpt-tune precision of the trainer's (PRECISION_OF_TRAINER)."""
    name = str(trainer.precision)
    if name not in PRECISION_OF_TRAINER:
        _refuse(f"Trainer(precision={name!r}) is not one ckpt-tune runs: it runs "
                f"{', '.join(PRECISION_OF_TRAINER)}",
                f"pass CheckpointTuner(precision=...) with the closest of {', '.join(vocab.PRECISIONS)}")
    return PRECISION_OF_TRAINER[name]


def _optimizer(trainer: pl.Trainer) -> str:
    """The ckpt-tune optimizer of the one `configure_optimizers` made (vocab's registry)."""
    opts = trainer.optimizers
    if not opts:
        return "none"
    if len(opts) > 1:
        _refuse(f"configure_optimizers made {len(opts)} optimizers; the search runs one",
                f"pass CheckpointTuner(optimizer=...), one of {', '.join(vocab.OPTIMIZERS)}")
    opt = opts[0]
    groups = opt.param_groups
    name = None
    if type(opt) in (torch.optim.AdamW, torch.optim.Adam) and not any(g.get("amsgrad") for g in groups):
        name = "adamw" if type(opt) is torch.optim.AdamW else "adam"
    elif type(opt) is torch.optim.SGD:
        name = "sgd-momentum" if any(g.get("momentum", 0) for g in groups) else "sgd"
    if name is None:
        _refuse(f"the optimizer {type(opt).__qualname__} from configure_optimizers is not one ckpt-tune runs "
                f"({', '.join(n for n in vocab.OPTIMIZERS if n != 'none')}; Adam/AdamW without amsgrad)",
                "pass CheckpointTuner(optimizer=...) with the one that keeps as many states per parameter")
    return vocab.optimizer(name).name


def _log_outcome(outcome: SearchOutcome) -> None:
    """The plan, as log lines."""
    plan, budget = outcome.plan, outcome.budget
    entries = ", ".join(e.label for e in plan.checkpoint) or "(none)"
    verified = "" if plan.verified_peak_bytes is None else f", {format_bytes(plan.verified_peak_bytes)} verified"
    log.info("ckpt-tune: batch %d × %d accumulation step%s, checkpointed: %s", plan.batch_size,
             plan.grad_accum_steps, "" if plan.grad_accum_steps == 1 else "s", entries)
    log.info("ckpt-tune: peak %s predicted%s, budget %s (%s); recompute %s of the step",
             format_bytes(plan.predicted_peak_bytes), verified, format_bytes(budget.usable_bytes), budget.source,
             format_percent(plan.predicted_recompute_fraction))
    for note in outcome.result.notes:
        log.info("ckpt-tune: %s", note)
