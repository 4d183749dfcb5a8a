"""CheckpointTuner: a real `Trainer.fit` on CPU plans at fit start, then trains at the batch it found, with
its plan applied, within the budget as the independent harness measures it (tests/harness.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

from ckpt_tune.errors import CkptTuneError, NoFitError, UserCodeError  # noqa: E402
from ckpt_tune.integrations.lightning import CheckpointTuner, _optimizer  # noqa: E402
from ckpt_tune.measure.loader import Target  # noqa: E402
from ckpt_tune.measure.session import Settings, load  # noqa: E402
from ckpt_tune.plan.apply import applied_names  # noqa: E402
from tests.harness import measured_peak  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WIDTH, TOKENS, SAMPLES = 64, 16, 512
BUDGET = "4MiB"


class Block(nn.Module):
    """A residual MLP block that counts its forwards: a checkpointed one runs twice per step."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return x + self.fc2(torch.relu(self.fc1(x)))


class LitMLP(pl.LightningModule):
    def __init__(self, batch_size: int | None = 4, blocks: int = 4) -> None:
        super().__init__()
        if batch_size is not None:
            self.batch_size = batch_size
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*[Block() for _ in range(blocks)])
        self.head = nn.Linear(WIDTH, 1)
        self.seen: list[int] = []  # the batch sizes training_step was called with

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.blocks(x)).squeeze(-1), y)

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0].shape[0])
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=getattr(self, "batch_size", 4))


class Data(pl.LightningDataModule):
    """The same samples from a datamodule that holds the batch size."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=self.batch_size, shuffle=True)


class Broken(LitMLP):
    def training_step(self, batch, batch_idx):
        return self.loss(batch[0])  # a mistake: the inputs alone, not (inputs, targets)


class FixedBatch(LitMLP):
    """A module whose train_dataloader ignores its batch_size."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=4)


_g = torch.Generator().manual_seed(0)
DATA = (torch.randn(SAMPLES, TOKENS, WIDTH, generator=_g), torch.randn(SAMPLES, TOKENS, generator=_g))


def dataset() -> TensorDataset:
    return TensorDataset(*DATA)


def make_batch(n: int):
    """What the train dataloader collates from the dataset's first n samples: new tensors of n samples."""
    return DATA[0][:n].clone(), DATA[1][:n].clone()


def fit(model: LitMLP, tuner: CheckpointTuner, **kwargs) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[tuner], **{k: v for k, v in kwargs.items() if k != "fit"},
    )
    trainer.fit(model, **kwargs.get("fit", {}))
    return trainer


def test_fit_trains_at_the_batch_found_with_the_plan_applied_within_the_budget(caplog, tmp_path):
    model = LitMLP()
    tuner = CheckpointTuner(vram=BUDGET, candidates="blocks,segments", out=tmp_path / "plan.yaml")
    with caplog.at_level(logging.INFO, logger="ckpt_tune.integrations.lightning"):
        trainer = fit(model, tuner)
    plan = tuner.plan
    b = plan.batch_size
    assert (plan.precision, plan.optimizer, plan.device, plan.grad_accum_steps) == ("fp32", "adamw", "cpu", 1)
    assert model.batch_size == b
    assert trainer.accumulate_grad_batches == 1
    assert model.seen == [b, b]  # both steps ran at the batch found
    planned = {n for e in plan.checkpoint for n in e.modules}
    assert planned
    assert set(applied_names(model)) == planned
    for i, block in enumerate(model.blocks):  # a checkpointed block's forward runs again in backward
        assert block.forwards == (4 if f"blocks.{i}" in planned else 2), i
    # the independent harness: the step at that batch with that plan fits; without checkpointing it does not
    budget = tuner.outcome.budget.usable_bytes
    peak = measured_peak(LitMLP, make_batch, lambda m, batch: m.loss(batch), b, checkpoint=list(plan.checkpoint))
    plain = measured_peak(LitMLP, make_batch, lambda m, batch: m.loss(batch), b)
    assert peak == plan.verified_peak_bytes <= budget < plain
    assert (tmp_path / "plan.yaml").read_text().count(f"batch_size: {b}") == 1
    assert f"ckpt-tune: batch {b} × 1 accumulation step" in caplog.text
    # a later fit of the same module trains with the plan found, without searching again
    outcome = tuner.outcome
    fit(model, tuner)
    assert tuner.outcome is outcome
    assert model.seen == [b] * 4


def test_a_module_without_batch_size_gets_a_clear_error_and_is_left_as_it_was():
    model = LitMLP(batch_size=None)
    with pytest.raises(CkptTuneError, match="no 'batch_size' attribute to write the batch size to") as exc:
        fit(model, CheckpointTuner(vram=BUDGET))
    assert "self.batch_size" in exc.value.hint
    assert model.seen == []
    assert applied_names(model) == ()


def test_a_budget_nothing_fits_is_a_no_fit_error_and_leaves_the_module_as_it_was():
    model = LitMLP()
    with pytest.raises(NoFitError, match="more than the budget before any activation") as exc:
        fit(model, CheckpointTuner(vram="1MiB"))
    assert exc.value.exit_code == 3
    assert model.batch_size == 4
    assert model.seen == []
    assert applied_names(model) == ()
    assert all(block.forwards == 0 for block in model.blocks)


def test_the_optimizer_comes_from_configure_optimizers_when_ckpt_tune_knows_it():
    params = [nn.Parameter(torch.zeros(2))]

    def trainer(*opts):
        return SimpleNamespace(optimizers=list(opts))

    assert _optimizer(trainer(torch.optim.SGD(params, lr=0.1, momentum=0.9))) == "sgd-momentum"
    assert _optimizer(trainer(torch.optim.SGD(params, lr=0.1))) == "sgd"
    assert _optimizer(trainer(torch.optim.Adam(params))) == "adam"
    assert _optimizer(trainer()) == "none"
    with pytest.raises(CkptTuneError, match="RMSprop from configure_optimizers is not one ckpt-tune runs") as exc:
        _optimizer(trainer(torch.optim.RMSprop(params)))
    assert "CheckpointTuner(optimizer=" in exc.value.hint
    with pytest.raises(CkptTuneError, match="not one ckpt-tune runs"):
        _optimizer(trainer(torch.optim.AdamW(params, amsgrad=True)))


def test_a_loaded_target_passes_through_load_unless_the_settings_name_another():
    t = Target("lightning:x", "x", None, "x", LitMLP, make_batch, None, "make_batch", "default")
    assert load(t, Settings()) is t
    with pytest.raises(CkptTuneError, match="the settings also name loss_fn"):
        load(t, Settings(loss_fn="other.py:loss"))


def test_a_target_batch_becomes_the_datamodules_micro_batch_and_the_trainers_accumulation():
    model, data = LitMLP(batch_size=None), Data()
    tuner = CheckpointTuner(vram=BUDGET, target_batch=SAMPLES // 4, candidates="blocks")
    trainer = fit(model, tuner, fit={"datamodule": data})
    plan = tuner.plan
    assert plan.grad_accum_steps > 1
    assert plan.batch_size * plan.grad_accum_steps == SAMPLES // 4
    assert data.batch_size == plan.batch_size
    assert not hasattr(model, "batch_size")
    assert trainer.accumulate_grad_batches == plan.grad_accum_steps
    assert model.seen == [plan.batch_size] * (2 * plan.grad_accum_steps)  # 2 optimizer steps
    truth = measured_peak(LitMLP, make_batch, lambda m, batch: m.loss(batch), plan.batch_size,
                          checkpoint=list(plan.checkpoint), accum_steps=plan.grad_accum_steps)
    assert truth == plan.verified_peak_bytes <= tuner.outcome.budget.usable_bytes


def test_a_dataloader_that_ignores_batch_size_is_refused_and_everything_is_put_back():
    model = FixedBatch()
    tuner = CheckpointTuner(vram=BUDGET, batch_size=16, candidates="blocks")
    with pytest.raises(CkptTuneError, match=r"rebuilt with batch_size=4 after batch_size was set to 16") as exc:
        fit(model, tuner)
    assert "batch_size=self.batch_size" in exc.value.hint
    assert model.batch_size == 4
    assert applied_names(model) == ()
    assert model.seen == []
    assert tuner.plan is None


@pytest.mark.parametrize(
    ("kwargs", "tuner", "message"),
    [
        ({"accumulate_grad_batches": 2}, {}, r"accumulate_grad_batches=2\) without target_batch"),
        ({"fit": {"train_dataloaders": DataLoader(TensorDataset(*DATA), batch_size=4)}}, {},
         "cannot change the batch size of dataloaders passed to fit"),
        ({}, {"batch_arg_name": "micro_batch"}, "no 'micro_batch' attribute"),
    ],
    ids=["accumulation", "loader-to-fit", "batch-arg-name"],
)
def test_fits_it_cannot_plan_for_are_refused_before_any_step(kwargs, tuner, message):
    model = LitMLP()
    with pytest.raises(CkptTuneError, match=message):
        fit(model, CheckpointTuner(vram=BUDGET, **tuner), **kwargs)
    assert model.seen == []
    assert model.batch_size == 4


def test_an_error_in_training_step_names_the_users_line_and_leaves_the_module_as_it_was():
    model = Broken()
    with pytest.raises(UserCodeError, match=r"Broken\.training_step raised ValueError: .*\(at .*test_integration_lightning\.py:\d+\)"):
        fit(model, CheckpointTuner(vram=BUDGET))
    assert model.batch_size == 4
    assert applied_names(model) == ()
