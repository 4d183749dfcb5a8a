"""ckpt_tune.integrations.hf: a plan applied to a real `transformers.Trainer`, trained on CPU.

Every run is a tiny GPT-2 (2 layers, n_embd 32, vocabulary 64, 16 tokens per sample) for two optimizer
steps; forward pre-hooks count what the model really ran: the batch each root forward saw, and the
forwards of a module inside each block (a planned block's run twice per micro-batch: forward and
recompute).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ckpt_tune.errors import CkptTuneError, PlanError  # noqa: E402
from ckpt_tune.integrations.hf import PlanGuard, apply_to_trainer  # noqa: E402
from ckpt_tune.plan.apply import applied_names  # noqa: E402
from ckpt_tune.plan.entry import member_names  # noqa: E402
from ckpt_tune.plan.file import Plan  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

SEQ, VOCAB = 16, 64
CONFIG = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": VOCAB, "n_positions": SEQ,
          "bos_token_id": 0, "eos_token_id": 0}
BLOCKS = ("transformer.h.0", "transformer.h.1")


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    fields = {k: v for k, v in CONFIG.items() if k != "model_type"}
    return transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(**fields))


def dataset(n: int = 16, seq: int = SEQ) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, VOCAB, (seq,), generator=gen) for _ in range(n)]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def trainer(model, tmp_path, data=None, **overrides):
    """A Trainer for two optimizer steps on CPU, built with a batch the plan will replace (8 × 1)."""
    kw = dict(output_dir=str(tmp_path), max_steps=2, report_to=[], use_cpu=True, save_strategy="no",
              logging_strategy="no", dataloader_num_workers=0, per_device_train_batch_size=8,
              gradient_accumulation_steps=1, disable_tqdm=True, learning_rate=1e-2)
    args = transformers.TrainingArguments(**{**kw, **overrides})
    return transformers.Trainer(model=model, args=args, train_dataset=dataset() if data is None else data)


def plan(checkpoint=("transformer.h.0",), batch_size=2, grad_accum_steps=2, **kw) -> Plan:
    return Plan(target=kw.pop("target", "hf:config.json"), device="cpu", precision=kw.pop("precision", "fp32"),
                optimizer="adamw", budget_bytes=None, batch_size=batch_size, grad_accum_steps=grad_accum_steps,
                checkpoint=checkpoint, predicted_peak_bytes=0, predicted_recompute_fraction=0.0,
                seq_len=kw.pop("seq_len", SEQ), **kw)


class Counts(transformers.TrainerCallback):
    """What the run did: the batch of every root forward, the forwards of one parameterised module inside
    each watched module, and the root forwards done when each optimizer step ended."""

    def __init__(self, model, watched):
        self.batches: list[int] = []
        self.runs = dict.fromkeys(watched, 0)
        self.at_step_end: list[int] = []
        model.register_forward_pre_hook(lambda m, a, k: self.batches.append(k["input_ids"].shape[0]), with_kwargs=True)
        for name in watched:
            inner = next(c for c in model.get_submodule(name).children() if any(True for _ in c.parameters()))
            inner.register_forward_pre_hook(lambda m, a, name=name: self.runs.__setitem__(name, self.runs[name] + 1))

    def on_step_end(self, args, state, control, **kwargs):
        self.at_step_end.append(len(self.batches))


def test_train_uses_the_plans_batch_and_recomputes_the_planned_block_only(tmp_path, caplog):
    model = gpt2()
    model.activation_checkpointing_enable()  # Hugging Face's own, on every block: turned off by the plan
    t = trainer(model, tmp_path, activation_checkpointing=True)
    with caplog.at_level(logging.WARNING, logger="ckpt_tune.integrations.hf"):
        names = apply_to_trainer(t, plan())
    assert names == ("transformer.h.0",)
    assert applied_names(model) == names
    assert "turned Hugging Face activation checkpointing off (args.activation_checkpointing" in caplog.text
    assert (t.args.per_device_train_batch_size, t.args.gradient_accumulation_steps, t._train_batch_size) == (2, 2, 2)
    assert not t.args.activation_checkpointing
    assert not model.is_activation_checkpointing
    counts = Counts(model, BLOCKS)
    t.add_callback(counts)
    t.train()
    assert counts.batches == [2, 2, 2, 2]  # micro-batch 2
    assert counts.at_step_end == [2, 4]  # 2 forwards per optimizer step
    assert counts.runs == {"transformer.h.0": 8, "transformer.h.1": 4}  # forward + recompute; once


def test_the_run_learns_what_the_same_run_without_ckpt_tune_learns(tmp_path):
    """Checkpointing, and the guard's reading of the first batch, change memory and time only: the weights
    after two steps equal, bit for bit, those of a plain run built with the plan's batch (dropout on)."""
    planned, plain = gpt2(), gpt2()
    t = trainer(planned, tmp_path / "planned")
    apply_to_trainer(t, plan())
    t.train()
    trainer(plain, tmp_path / "plain", per_device_train_batch_size=2, gradient_accumulation_steps=2).train()
    assert plain.config.attn_pdrop > 0
    changed = [n for n, p in plain.state_dict().items() if not torch.equal(p, planned.state_dict()[n])]
    assert changed == []
    assert not torch.equal(plain.transformer.h[0].mlp.c_fc.weight, gpt2().transformer.h[0].mlp.c_fc.weight)


def test_peft_model_trains_a_base_model_plan_and_its_lora_weights_learn(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True,
                           task_type="CAUSAL_LM")
    model = peft.get_peft_model(gpt2(), lora)
    # the frozen embedding's output does not require grad (no hook makes it): the checkpointed block's LoRA
    # weights must learn anyway
    wte = model.get_base_model().transformer.wte
    assert not wte.weight.requires_grad
    assert not wte._forward_hooks
    lora_0 = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n and ".h.0." in n}
    assert len(lora_0) == 2
    t = trainer(model, tmp_path)
    names = apply_to_trainer(t, plan())  # made on the base model: transformer.h.0
    assert names == ("base_model.model.transformer.h.0",)
    assert applied_names(model) == names
    peft_blocks = tuple(f"base_model.model.{b}" for b in BLOCKS)
    counts = Counts(model, peft_blocks)
    t.add_callback(counts)
    t.train()
    assert counts.batches == [2, 2, 2, 2]
    assert counts.at_step_end == [2, 4]
    assert counts.runs == dict(zip(peft_blocks, (8, 4), strict=True))
    after = dict(model.named_parameters())
    assert all(not torch.equal(after[n], before) for n, before in lora_0.items())


def test_peft_model_takes_a_plan_with_its_own_names(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM")
    model = peft.get_peft_model(gpt2(), lora)
    t = trainer(model, tmp_path)
    segment = [["base_model.model.transformer.h.0", "base_model.model.transformer.h.1"]]
    assert apply_to_trainer(t, plan(segment)) == tuple(segment[0]) == applied_names(model)


@pytest.mark.parametrize(
    ("kw", "then", "says", "fix"),
    [
        ({"precision": "bf16-mixed"}, None, "precision bf16-mixed, and the run trains in fp32",
         "TrainingArguments(bf16=True), float32 weights); or else make a plan for this run: "
         "ckpt-tune search --hf-config config.json --vram SIZE --seq-len 16 --precision fp32"),
        ({"seq_len": 8}, None, "8 tokens per sample, and the first batch has 16",
         "truncate the samples to 8 tokens; or else make a plan for this run: "
         "ckpt-tune search --hf-config config.json --vram SIZE --seq-len 16"),
        ({"world_size": 2, "shard": "zero1", "sharding": "measured"}, None,
         "2 rank(s) (zero1), and the run has 1 rank(s)", "run it on 2 rank(s)"),
        ({}, ("per_device_train_batch_size", 4), "micro-batch 2 × accumulation 2, and the arguments now say 4 × 2",
         "leave per_device_train_batch_size and gradient_accumulation_steps as apply_to_trainer set them"),
    ],
    ids=["precision", "seq_len", "world_size", "batch-changed"],
)
def test_guard_refuses_a_run_the_plan_was_not_made_for(tmp_path, kw, then, says, fix):
    model = gpt2()
    t = trainer(model, tmp_path)
    apply_to_trainer(t, plan(**kw))
    if then:
        setattr(t.args, *then)
    counts = Counts(model, BLOCKS)
    t.add_callback(counts)
    with pytest.raises(CkptTuneError, match="was made for another run") as err:
        t.train()
    assert says in err.value.message
    assert fix in err.value.hint
    assert counts.batches == []  # refused before the first forward


def test_guard_refuses_a_model_replaced_after_the_plan(tmp_path):
    t = trainer(gpt2(), tmp_path)
    apply_to_trainer(t, plan())
    t.model = t.model_wrapped = gpt2()
    with pytest.raises(CkptTuneError, match=r"1 of its 1 module\(s\) are not checkpointed") as err:
        t.train()
    assert "apply_to_trainer after the last change to trainer.model" in err.value.hint


def test_a_missing_module_is_ckpt_tunes_error_and_leaves_the_trainer_as_it_was(tmp_path):
    model = gpt2()
    model.activation_checkpointing_enable()
    t = trainer(model, tmp_path, activation_checkpointing=True)
    with pytest.raises(PlanError, match=r"no module named transformer\.h\.9") as err:
        apply_to_trainer(t, plan(("transformer.h.9",)))
    assert err.value.hint.startswith("close matches: ")
    assert "transformer.h.0" in err.value.hint
    assert applied_names(model) == ()
    assert (t.args.per_device_train_batch_size, t.args.gradient_accumulation_steps, t._train_batch_size) == (8, 1, 8)
    assert t.args.activation_checkpointing
    assert model.is_activation_checkpointing
    assert not any(isinstance(cb, PlanGuard) for cb in t.callback_handler.callbacks)


def test_a_trainer_with_model_init_or_a_bare_model_is_refused(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    t = transformers.Trainer(model_init=gpt2, args=args, train_dataset=dataset())
    with pytest.raises(CkptTuneError, match="built with model_init, which builds a fresh model"):
        apply_to_trainer(t, plan())
    with pytest.raises(CkptTuneError, match=r"takes a transformers\.Trainer, got GPT2LMHeadModel") as err:
        apply_to_trainer(t.model, plan())
    assert "ckpt_tune.apply(model, plan)" in err.value.hint


def test_a_searched_hf_config_plan_trains_on_the_model_built_from_that_config(tmp_path):
    import ckpt_tune

    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    settings = ckpt_tune.Settings(device="cpu", hf_config=str(config), seq_len=SEQ)
    # 900 KiB at batch 4: the step without checkpointing needs more, so the plan checkpoints something
    found = ckpt_tune.search(None, vram="900KiB", batch_size=4, settings=settings, segments=False,
                             candidates=frozenset({"blocks"})).plan
    assert (found.seq_len, found.batch_size, found.grad_accum_steps) == (SEQ, 4, 1)
    assert found.checkpoint
    planned = member_names(found.checkpoint)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    t = trainer(model, tmp_path / "out")
    assert apply_to_trainer(t, found) == tuple(planned)
    counts = Counts(model, [*planned, *(b for b in BLOCKS if b not in planned)])
    t.add_callback(counts)
    t.train()
    assert counts.batches == [4, 4]
    assert counts.at_step_end == [1, 2]
    assert counts.runs == {n: 4 if n in planned else 2 for n in counts.runs}
