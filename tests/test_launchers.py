"""`search --emit`: a plan as torchtitan's TOML, DeepSpeed's JSON and TrainingArguments' keyword arguments.

The mapping is checked against the launchers' own code: the outputs are read by their parsers
(torchtitan's ConfigManager, DeepSpeedConfig, TrainingArguments), and the blocks each layout names are
the blocks torchtitan's and transformers' own switches wrap. One CLI run checks the measured peak of
the closest layout against a step under transformers' own checkpointing switch.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt_tune.plan.file import Plan
from ckpt_tune.plan.launchers import HfApi, Layers, closest, render

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = tuple(f"layers.{i}" for i in range(6))
LAYERS = Layers(BLOCKS, BLOCKS)
GiB = 1 << 30


def plan(checkpoint, **fields) -> Plan:
    values = dict(
        target="examples/gpt.py:build", device="cuda", precision="bf16-mixed", optimizer="adamw",
        budget_bytes=8 * GiB, batch_size=4, grad_accum_steps=2, checkpoint=checkpoint, seq_len=2048,
        predicted_peak_bytes=7 * GiB, predicted_recompute_fraction=0.2, verified_peak_bytes=7 * GiB,
    )
    return Plan(**{**values, **fields})


EVERY_OTHER = ("layers.1", "layers.3", "layers.5")
SEGMENTS = (("layers.0", "layers.1", "layers.2"), ("layers.3", "layers.4", "layers.5"))
OPS = tuple(f"{b}@half-matmuls" for b in BLOCKS)
ZERO3 = dict(world_size=8, shard="zero3", sharding="measured", shard_units=BLOCKS)


def names(entries) -> list[str]:
    return [e.label for e in entries]


# -- the pure mapping --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("checkpoint", "ac", "closest_labels", "exact", "cannot"),
    [
        ((), {"mode": "none"}, [], True, []),
        (BLOCKS, {"mode": "full"}, list(BLOCKS), True, []),
        # torchtitan's counter starts at 1: "2" checkpoints blocks 1, 3, 5
        (EVERY_OTHER, {"mode": "selective", "selective_ac_option": "2"}, list(EVERY_OTHER), True, []),
        (("layers.0", "layers.2"), {"mode": "full"}, list(BLOCKS), False, ["layers.0, layers.2 (2 of 6 blocks)"]),
        (SEGMENTS, {"mode": "full"}, list(BLOCKS), False, ["segments", "layers.0..layers.2, layers.3..layers.5"]),
        (OPS, {"mode": "selective", "selective_ac_option": "op"}, list(OPS), True, []),
        (("layers.2@matmuls",), {"mode": "selective", "selective_ac_option": "3"}, ["layers.2", "layers.5"], False,
         ["op policies", "layers.2@matmuls"]),
        (tuple(f"{b}@attention" for b in BLOCKS), {"mode": "selective", "selective_ac_option": "op"}, list(OPS), False,
         ["the op policy attention"]),
        (("layers.4.mlp",), {"mode": "selective", "selective_ac_option": "5"}, ["layers.4"], False,
         ["sub-modules of a block", "layers.4.mlp"]),
    ],
)
def test_torchtitan_layout(checkpoint, ac, closest_labels, exact, cannot):
    e = closest(plan(checkpoint), "torchtitan", LAYERS)
    assert e.settings["activation_checkpoint"] == ac
    assert names(e.closest.checkpoint) == closest_labels
    assert e.exact is exact
    said = " | ".join(e.cannot)
    assert all(c in said for c in cannot), said
    assert bool(e.cannot) is not exact


def test_torchtitan_batch_precision_and_sharding():
    e = closest(plan(BLOCKS, **ZERO3), "torchtitan", LAYERS)
    assert e.settings["training"] == {"local_batch_size": 4, "global_batch_size": 4 * 2 * 8, "seq_len": 2048,
                                      "dtype": "float32", "mixed_precision_param": "bfloat16"}
    assert e.settings["parallelism"] == {"data_parallel_shard_degree": 8, "fsdp_reshard_after_forward": "always"}
    assert e.exact
    # no fp16 and no ZeRO-1 in torchtitan: bf16 mixed, and FSDP without resharding (ZeRO-2)
    z1 = closest(plan(BLOCKS, precision="fp16-mixed", world_size=8, shard="zero1", sharding="measured"), "torchtitan", LAYERS)
    assert (z1.closest.precision, z1.closest.shard, z1.closest.shard_units) == ("bf16-mixed", "zero2", BLOCKS)
    assert z1.settings["parallelism"]["fsdp_reshard_after_forward"] == "never"
    assert not z1.exact
    assert len(z1.cannot) == 2
    pure = closest(plan(BLOCKS, precision="bf16", seq_len=None), "torchtitan", LAYERS)
    assert pure.settings["training"]["dtype"] == "bfloat16"
    assert "seq_len" not in pure.settings["training"]


@pytest.mark.parametrize(
    ("checkpoint", "kwargs", "closest_labels", "exact"),
    [
        ((), None, [], True),
        (BLOCKS, {"use_reentrant": False}, list(BLOCKS), True),
        # transformers counts from 0: every_n_layers 2 checkpoints layers 0, 2, 4
        (("layers.0", "layers.2", "layers.4"), {"use_reentrant": False, "every_n_layers": 2}, ["layers.0", "layers.2", "layers.4"], True),
        (EVERY_OTHER, {"use_reentrant": False}, list(BLOCKS), False),
        (SEGMENTS, {"use_reentrant": False}, list(BLOCKS), False),
        (("layers.0.attn", "layers.3"), {"use_reentrant": False, "every_n_layers": 3}, ["layers.0", "layers.3"], False),
        (OPS, {"use_reentrant": False}, list(BLOCKS), False),
    ],
)
def test_hf_layout(checkpoint, kwargs, closest_labels, exact):
    e = closest(plan(checkpoint), "hf-args", LAYERS)
    assert e.settings.get("activation_checkpointing_kwargs") == kwargs
    assert e.settings.get("activation_checkpointing", False) is bool(kwargs)
    assert e.settings["bf16"] is True
    assert e.settings["per_device_train_batch_size"] == 4
    assert names(e.closest.checkpoint) == closest_labels
    assert e.exact is exact


def test_hf_without_every_n_or_without_a_transformers_model():
    old = closest(plan(("layers.0", "layers.2", "layers.4")), "hf-args", LAYERS, HfApi("gradient_checkpointing", False))
    assert old.settings["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert names(old.closest.checkpoint) == list(BLOCKS)
    assert not old.exact
    plain = closest(plan(BLOCKS), "hf-args", Layers(BLOCKS, None))
    assert "activation_checkpointing" not in plain.settings
    assert plain.closest.checkpoint == ()
    assert "only transformers models have" in plain.cannot[0]
    assert any("ckpt_tune.apply(model, plan)" in h for h in plain.how)


@pytest.mark.parametrize(("shard", "stage"), [("none", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3), ("fsdp", 3)])
def test_deepspeed_stage_and_the_plan_itself(shard, stage):
    sharded = {} if shard == "none" else dict(world_size=8, shard=shard, sharding="measured")
    e = closest(plan(SEGMENTS, **sharded), "deepspeed", LAYERS)
    world = 8 if sharded else 1
    assert e.settings["zero_optimization"] == {"stage": stage}
    assert (e.settings["train_micro_batch_size_per_gpu"], e.settings["gradient_accumulation_steps"],
            e.settings["train_batch_size"]) == (4, 2, 4 * 2 * world)
    assert e.settings["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    # the config cannot choose modules: the plan runs as it is, with ckpt_tune.apply
    assert e.exact
    assert e.closest.checkpoint == e.plan.checkpoint
    assert "cannot choose modules" in e.cannot[0]


def test_the_peak_line_says_whether_it_fits():
    e = closest(plan(("layers.0", "layers.2")), "torchtitan", LAYERS)
    text = render(e, 9 * GiB)
    assert "# closest it can express: every block (6:" in text
    assert f"# measured peak: 9.00 GiB ({9 * GiB} bytes) at batch 4, one recorded step of this layout: over the 8.00 GiB budget by 1.00 GiB" in text
    assert "# the plan itself: 7.00 GiB verified" in text
    exact = render(closest(plan(BLOCKS), "torchtitan", LAYERS), 7 * GiB)
    assert "the plan itself, as the search verified it: fits the 8.00 GiB budget" in exact


# -- the launchers' own parsers and switches --------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", [EVERY_OTHER, OPS, ("layers.2@matmuls",), BLOCKS])
def test_torchtitan_reads_the_toml_and_wraps_the_blocks_named(tmp_path, monkeypatch, checkpoint):
    pytest.importorskip("torchtitan")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import activation_checkpoint as titan_ac

    e = closest(plan(checkpoint, **ZERO3), "torchtitan", LAYERS)
    path = tmp_path / "job.toml"
    path.write_text(render(e, 7 * GiB))
    job = ConfigManager().parse_args(["--job.config_file", str(path)])
    assert (job.training.local_batch_size, job.training.global_batch_size, job.training.seq_len) == (4, 64, 2048)
    assert job.training.mixed_precision_param == "bfloat16"
    assert job.parallelism.data_parallel_shard_degree == 8
    assert job.parallelism.fsdp_reshard_after_forward == "always"
    # torchtitan's own per-block decision (apply_ac's loop), from a fresh counter
    monkeypatch.setattr(titan_ac, "_layer_sac_count", 0)
    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(len(BLOCKS))})
    for layer_id, block in list(model.layers.named_children()):
        wrapped = titan_ac._apply_ac_to_transformer_block(block, job.activation_checkpoint, base_fqn=f"layers.{layer_id}",
                                                          op_sac_save_list=set())
        model.layers.register_module(layer_id, wrapped)
    wrapped = [f"layers.{i}" for i, m in model.layers.named_children() if isinstance(m, CheckpointWrapper)]
    assert wrapped == [e.modules[0] for e in e.closest.checkpoint]


@pytest.mark.parametrize(("precision", "shard"), [("bf16-mixed", "none"), ("fp16-mixed", "zero3"), ("bf16", "zero1")])
def test_deepspeed_config_reads_the_json(monkeypatch, precision, shard):
    pytest.importorskip("deepspeed")
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    sharded = {} if shard == "none" else dict(world_size=8, shard=shard, sharding="measured")
    data = json.loads(render(closest(plan(EVERY_OTHER, precision=precision, **sharded), "deepspeed", LAYERS), 7 * GiB))
    assert data["_comment"][0].startswith("ckpt-tune search --emit deepspeed")
    if sharded:
        # rank 0 of the 8-rank job (initialising DeepSpeed's communication backend here would compile its ops)
        monkeypatch.setattr(deepspeed.comm, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(deepspeed.comm, "get_world_size", lambda group=None: 8)
    config = DeepSpeedConfig(data)
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (4, 2)
    assert config.train_batch_size == 4 * 2 * (8 if sharded else 1)
    assert config.zero_optimization_stage == {"none": 0, "zero1": 1, "zero3": 3}[shard]
    if precision == "bf16":
        assert config.bfloat16_config.enabled
        assert config.bfloat16_config.bf16_optimizer_states
    else:
        assert config.torch_autocast_enabled
        assert config.torch_autocast_dtype == {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[precision]
    assert config.activation_checkpointing_config.partition_activations is False


def _tiny_gpt2(n_layer: int, path: Path | None = None):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, n_positions=64, vocab_size=256)
    if path is not None:
        config.to_json_file(path)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("checkpoint", [("transformer.h.0", "transformer.h.3"), ("transformer.h.1.mlp",), ()])
def test_training_arguments_take_the_kwargs_and_switch_the_layers_named(tmp_path, checkpoint):
    from transformers import TrainingArguments

    from ckpt_tune.tune.launchers import hf_api, hf_layers

    model = _tiny_gpt2(6)
    layers = Layers(tuple(f"transformer.h.{i}" for i in range(6)), hf_layers(model))
    assert layers.hf_layers == layers.blocks
    e = closest(plan(checkpoint, precision="fp32"), "hf-args", layers, hf_api())
    kwargs = ast.literal_eval(render(e, 7 * GiB))
    args = TrainingArguments(output_dir=str(tmp_path), **kwargs)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 2)
    assert args.activation_checkpointing is bool(checkpoint)
    # what Trainer does with them (its train() set-up), on the model: the layers switched on
    if args.activation_checkpointing:
        gc_kwargs = dict(args.activation_checkpointing_kwargs)
        every = gc_kwargs.pop("every_n_layers", 1)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=gc_kwargs, every_n_layers=every)
    on = [n for n in layers.hf_layers if model.get_submodule(n).gradient_checkpointing]
    assert on == [e.modules[0] for e in e.closest.checkpoint]


# -- the command line --------------------------------------------------------------------------------------


@pytest.fixture
def cli(run, monkeypatch):
    """conftest's in-process `run`, with no project configuration read."""
    monkeypatch.setenv("CKPT_TUNE_NO_CONFIG", "1")
    return run


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--emit", "hf-args", "--json"], ["--emit-out", "--json"]),
        (["--emit-out", "x.toml"], ["no --emit launcher"]),
        (["--emit", "torchtitn"], ["unknown --emit", "torchtitan"]),
    ],
)
def test_emit_options_refused_before_the_search(cli, tmp_path, extra, words):
    code, out, err = cli("search", "no/such/file.py:build", "--device", "cpu", "--vram", "1MiB", *extra)
    assert code == 1
    assert out == ""
    assert "Traceback" not in err
    assert all(w in err for w in words), err


def test_search_emits_hf_args_with_the_measured_peak(cli, tmp_path):
    from ckpt_tune.measure import user_code
    from ckpt_tune.measure.hf import load_hf_target
    from tests.harness import measured_peak

    config = tmp_path / "config.json"
    _tiny_gpt2(2, config)
    out = tmp_path / "args.py"
    # only sub-modules may be planned: the plan is never a layout TrainingArguments switches, so the
    # closest layout's peak is measured by a step of its own
    code, stdout, err = cli("search", "--hf-config", str(config), "--device", "cpu", "--seq-len", "16", "--vram", "1.1MiB",
                            "--batch-size", "4", "--candidates", "submodules", "--emit", "hf-args", "--emit-out", str(out),
                            "--json")
    assert code == 0, err
    assert f"hf-args configuration written to {out}" in err
    result = json.loads(stdout)["emit"]  # the configuration went to the file, the result to stdout
    assert result["launcher"] == "hf-args"
    assert result["measured"]
    assert not result["exact"]
    text = out.read_text()
    found = re.search(r"^# measured peak: \S+ \S+ \((\d+) bytes\) at batch 4, one recorded step of this layout: "
                      r"(fits|over) the 1\.1 MiB budget", text, re.M)
    assert found, text
    kwargs = ast.literal_eval(text)
    assert kwargs["per_device_train_batch_size"] == 4
    assert kwargs["activation_checkpointing"] is True
    assert "# closest it can express: every" in text
    assert "# TrainingArguments cannot express sub-modules" in text
    # the same step under transformers' own switch, with the emitted kwargs, peaks at the same byte
    t = load_hf_target(str(config), seq_len=16, attn="sdpa")
    gc_kwargs = dict(kwargs["activation_checkpointing_kwargs"])
    every = gc_kwargs.pop("every_n_layers", 1)

    def switch(model):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=gc_kwargs, every_n_layers=every)

    peak = measured_peak(t.build_fn, t.batch_fn, lambda m, b: user_code.compute_loss(t, m, b), 4, wrap=switch)
    assert int(found.group(1)) == peak == result["peak_bytes"]
    assert (found.group(2) == "fits") is (peak <= int(1.1 * (1 << 20)))
