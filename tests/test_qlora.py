"""LoRA and QLoRA: a 4-bit bitsandbytes base with peft adapters, recorded on the CPU and under fake
tensors, checked against the allocator's own events (tests/harness.py), never against the tool's code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

from ckpt_tune.measure import fake_inputs, loader, session  # noqa: E402
from ckpt_tune.measure.hf import load_hf_target  # noqa: E402
from ckpt_tune.measure.runner import StepRunner, StepSettings  # noqa: E402
from ckpt_tune.plan.file import load_plan, plan_to_yaml  # noqa: E402
from ckpt_tune.plan.finetune import PeftSpec  # noqa: E402
from ckpt_tune.plan.patch import patch_snippet  # noqa: E402
from tests import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "qlora_gpt.py"
LLAMA = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}
SEQ = 64
README_TOLERANCE = 0.001  # "profile within 0.1% of the allocator" (README, LoRA and QLoRA)


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qlora") / "config.json"
    path.write_text(json.dumps(LLAMA))
    return path


def _amp(loss_fn):
    def loss(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return loss_fn(model, batch)

    return loss


def _hf_loss(model, batch):
    return model(**batch).loss


def _example():
    sys.path.insert(0, str(EXAMPLE.parent))
    import qlora_gpt

    return qlora_gpt


def test_qlora_model_is_built_as_peft_and_bitsandbytes_teach(llama_config):
    model = load_hf_target(llama_config, seq_len=SEQ, peft=PeftSpec("qlora")).build_fn()
    four_bit = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    # every projection of both blocks (q, k, v, o, gate, up, down), never the output head
    assert len(four_bit) == 2 * 7
    assert not any("lm_head" in n for n in four_bit)
    w = model.get_submodule(four_bit[0]).weight
    assert w.quant_type == "nf4"
    assert w.compress_statistics
    assert w.dtype == torch.uint8
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 2 * 7  # A and B on each of the 14 projections (peft's all-linear)
    # prepare_model_for_kbit_training: the rest of the base in fp32
    assert model.get_output_embeddings().weight.dtype == torch.float32


def test_lora_base_is_bf16_and_frozen(llama_config):
    model = load_hf_target(llama_config, seq_len=SEQ, peft=PeftSpec("lora", r=4, targets=("q_proj", "v_proj"))).build_fn()
    base = [p for n, p in model.named_parameters() if "lora_" not in n]
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in base)
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(adapters) == 2 * 2 * 2
    assert all("q_proj" in n or "v_proj" in n for n in adapters)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw-8bit"])
def test_hf_qlora_profile_matches_the_allocator(llama_config, optimizer):
    spec = PeftSpec("qlora")
    target = load_hf_target(llama_config, seq_len=SEQ, peft=spec)
    target.build_fn()  # bitsandbytes' and transformers' one-time tables, outside the measurement
    opt = optimizer if optimizer == "adamw" else (lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3))
    real = harness.measured_peak(target.build_fn, target.batch_fn, _amp(_hf_loss), 2, optimizer=opt, count_build=True)
    settings = session.Settings(device="cpu", precision="bf16-mixed", optimizer=optimizer, hf_config=str(llama_config), seq_len=SEQ, peft=spec)
    prof = session.profile(None, batch_size=2, settings=settings, scaling=False)
    assert abs(prof.peak_bytes - real) <= README_TOLERANCE * real, f"tool {prof.peak_bytes:,} vs allocator {real:,}"


def _fake_cpu_peak(target: loader.Target, batch_size: int, precision: str = "bf16-mixed") -> int:
    """The step under fake tensors with the CPU allocator's rules (what the host guard records)."""
    step = StepSettings(device="meta", precision=precision, optimizer="adamw", fake_target="cpu")
    model = fake_inputs.build_fake_model(target)
    runner = StepRunner(model, fake_inputs.fake_batch_fn(target, "cpu"), lambda m, b: _amp(_user_loss(target))(m, b), step)
    with runner:
        return runner.measure(batch_size).peak_bytes


def _user_loss(target):
    from ckpt_tune.measure import user_code

    return lambda m, b: user_code.compute_loss(target, m, b)


def test_fake_qlora_step_equals_the_real_one(llama_config):
    """Under fake tensors nothing is quantized, yet the packed weights, their state and the kernels'
    dequantized copies come out at the real step's bytes (112 B apart of 9.1 MiB when written)."""
    target = load_hf_target(llama_config, seq_len=SEQ, peft=PeftSpec("qlora"))
    settings = session.Settings(device="cpu", precision="bf16-mixed", hf_config=str(llama_config), seq_len=SEQ, peft=PeftSpec("qlora"))
    real = session.profile(None, batch_size=3, settings=settings, scaling=False)
    fake = _fake_cpu_peak(target, 3)
    assert abs(fake - real.peak_bytes) <= README_TOLERANCE * real.peak_bytes, (fake, real.peak_bytes)


def test_a_build_under_fake_tensors_first_leaves_bitsandbytes_able_to_quantize_for_real(monkeypatch):
    """bitsandbytes keeps nested quantization's code book on the device it first quantized on: a fake
    (meta) build first in a process must not leave it on meta for the real builds after it."""
    import bitsandbytes.functional as bnb_f

    monkeypatch.setattr(bnb_f, "name2qmap", {})  # as in a fresh process
    fake_inputs.build_fake_model(session.load(f"{EXAMPLE}:build", session.Settings(device="cpu")))
    assert all(not code.is_meta for code in bnb_f.name2qmap.values())
    _example().build()  # quantizes on the CPU


def test_a_users_own_qlora_model_profiles_exactly_on_cpu_and_records_under_meta():
    mod = _example()
    mod.build()
    real = harness.measured_peak(mod.build, mod.make_batch, _amp(mod.loss_fn), 4, count_build=True)
    spec = f"{EXAMPLE}:build"
    cpu = session.profile(spec, batch_size=4, settings=session.Settings(device="cpu", precision="bf16-mixed"), scaling=False)
    assert abs(cpu.peak_bytes - real) <= README_TOLERANCE * real, f"tool {cpu.peak_bytes:,} vs allocator {real:,}"
    # the 4-bit state outside parameters is in the weights part: the parameters alone are less
    model = mod.build()
    params_only = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in [*model.parameters(), *model.buffers()]}.values())
    assert cpu.param_bytes > params_only
    meta = session.profile(spec, batch_size=4, settings=session.Settings(device="meta", precision="bf16-mixed"), scaling=False)
    assert meta.param_bytes >= cpu.param_bytes
    assert abs(meta.peak_bytes - cpu.peak_bytes) <= README_TOLERANCE * cpu.peak_bytes  # CUDA's 512 B blocks apart
    fake = _fake_cpu_peak(loader.load_target(spec), 4)
    assert abs(fake - cpu.peak_bytes) <= README_TOLERANCE * cpu.peak_bytes, (fake, cpu.peak_bytes)


def test_search_on_a_users_qlora_model_is_verified_and_holds_under_the_allocator(run):
    budget = 100 << 20
    code, out, err = run("search", f"{EXAMPLE}:build", "--device", "cpu", "--precision", "bf16-mixed", "--vram", "100MiB", "--json")
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert plan["verified_peak_bytes"] <= budget
    assert plan["checkpoint"]
    mod = _example()
    entries = [tuple(e) if isinstance(e, list) else e for e in plan["checkpoint"]]
    real = harness.measured_peak(mod.build, mod.make_batch, _amp(mod.loss_fn), plan["batch_size"], checkpoint=entries, count_build=True)
    assert real <= budget
    assert abs(plan["predicted_peak_bytes"] - real) <= 0.01 * real, (plan["predicted_peak_bytes"], real)


def test_peft_plan_file_round_trips_and_the_patch_loads_the_model_that_way(tmp_path, llama_config, run):
    code, _out, err = run("search", "--hf-config", str(llama_config), "--seq-len", str(SEQ), "--device", "meta", "--precision", "bf16-mixed",
                          "--peft", "qlora", "--lora-r", "8", "--vram", "1GiB", "--margin", "0", "--batch-size", "4", "--out", str(tmp_path / "plan.yaml"), "--patch", str(tmp_path / "patch.py"))
    assert code == 0, err
    plan = load_plan(tmp_path / "plan.yaml")
    assert plan.peft == PeftSpec("qlora", r=8)
    assert plan_to_yaml(plan) == (tmp_path / "plan.yaml").read_text()
    patch = (tmp_path / "patch.py").read_text()
    assert patch == patch_snippet(plan, hf=True)
    for needle in ("BitsAndBytesConfig(load_in_4bit=True", 'bnb_4bit_quant_type="nf4"', "bnb_4bit_use_double_quant=True",
                   "prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)", "LoraConfig(r=8, lora_alpha=32"):
        assert needle in patch
    compile(patch, "patch.py", "exec")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["examples/gpt.py:build", "--peft", "qlora"], "--peft applies to --hf-config models"),
        (["--hf-config", "CFG", "--peft", "dora"], "unknown --peft 'dora'"),
        (["--hf-config", "CFG", "--peft", "lora", "--lora-r", "0"], "--lora-r must be a positive integer"),
        (["--hf-config", "CFG", "--peft", "lora", "--lora-targets", "no_such_proj"], "peft rejected the LoRA settings"),
    ],
)
def test_peft_errors_are_one_clear_message(run, llama_config, args, message):
    args = [str(llama_config) if a == "CFG" else a for a in args]
    code, _out, err = run("profile", *args, "--device", "meta", "--batch-size", "1")
    assert code == 1, err
    assert message in err
    assert "Traceback" not in err


def test_qlora_without_bitsandbytes_says_what_to_install(run, llama_config, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    code, _out, err = run("profile", "--hf-config", str(llama_config), "--peft", "qlora", "--device", "meta")
    assert code == 1
    assert "needs bitsandbytes" in err
    assert "ckpt-tune[peft]" in err


def test_diagnose_records_qlora_and_lora_rows_as_peft_builds_them(llama_config, monkeypatch):
    """A config trained in full that does not fit: its QLoRA and LoRA rows are recorded steps of the
    peft model, equal to the allocator's peak of that model with the same layers checkpointed."""
    from ckpt_tune.diagnosis import diagnose, remedies, shard_remedies

    # only the rows under test: the other remedies have their own tests
    monkeypatch.setattr(remedies, "single_gpu_remedies", lambda study: None)
    monkeypatch.setattr(shard_remedies, "sharded_runs", lambda study: None)
    monkeypatch.setattr(remedies, "mixed_precision", lambda study: None)
    settings = session.Settings(device="cpu", precision="bf16-mixed", hf_config=str(llama_config), seq_len=SEQ)
    d = diagnose(None, vram="8MiB", batch_size=4, settings=settings)
    rows = {r.kind: r for r in d.remedies}
    assert set(rows) >= {"qlora", "lora"}
    assert rows["lora"].config["peft"]["method"] == "lora"  # peft's, not ckpt-tune's own adapter
    for kind in ("qlora", "lora"):
        row = rows[kind]
        assert row.basis == "measured"
        target = load_hf_target(llama_config, seq_len=SEQ, peft=PeftSpec(kind, r=8, alpha=16))
        real = harness.measured_peak(target.build_fn, target.batch_fn, _amp(_hf_loss), 4, checkpoint=row.config["checkpoint"], count_build=True)
        assert abs(row.peak_bytes - real) <= README_TOLERANCE * real, (kind, row.peak_bytes, real)


def test_check_records_the_peft_settings_and_refuses_a_run_without_them(run, llama_config, tmp_path):
    base = ["check", "--hf-config", str(llama_config), "--seq-len", str(SEQ), "--device", "meta", "--batch-size", "2",
            "--baseline", str(tmp_path / "memory.yaml")]
    code, _out, err = run(*base, "--peft", "qlora", "--update")
    assert code == 0, err
    assert "peft: {alpha: 32, dropout: 0.05, method: qlora, r: 16, targets: [all-linear]}" in (tmp_path / "memory.yaml").read_text()
    code, _out, err = run(*base, "--peft", "qlora")
    assert code == 0, err
    code, _out, err = run(*base)
    assert code == 1
    assert "--peft qlora --lora-r 16 --lora-alpha 32 --lora-dropout 0.05 --lora-targets all-linear" in " ".join(err.split())


def test_a_4bit_forward_holds_its_dequantized_weight_in_a_cuda_sized_timeline():
    """bitsandbytes' gemm_4bit returns only its output; for CUDA its scratch (the weight dequantized to
    the activation's dtype, the fp32 absmax) is added as a spike of 512 B blocks (scratch.bnb_cuda_scratch)."""
    from ckpt_tune.measure import fake
    from ckpt_tune.measure.fake import FakeRecorder

    n_out, n_in, rows = 512, 256, 2048
    layer = bnb.nn.Linear4bit(n_in, n_out, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(n_out, n_in, dtype=torch.bfloat16), requires_grad=False,
                                     compress_statistics=True, quant_type="nf4")
    layer = layer.to("cpu")  # quantized for real: the CPU kernels run on it
    with fake.running() as mode:
        x = mode.from_tensor(torch.zeros(rows, n_in, dtype=torch.bfloat16))
        with FakeRecorder("cuda") as rec:
            layer(x)
    blocks = n_out * n_in // 64  # one absmax per 64 weights
    scratch = n_out * n_in * 2 + blocks * 4  # both multiples of 512 here
    out = rows * n_out * 2  # the output, a storage of its own
    tl = rec.timeline
    spikes = [d for d, ptr in zip(tl.deltas, tl.ptrs) if ptr == 0 and d > 0]  # scratch: no storage of its own
    assert spikes == [scratch]
    assert out in tl.deltas
    assert not rec.unmodelled


@pytest.mark.parametrize("how", ["patch", "apply"])
def test_a_peft_plan_checkpoints_the_qlora_model_and_leaves_its_gradients_as_they_were(llama_config, how):
    """The patch (pasted where the peft model is made) and ckpt_tune.apply both recompute the planned
    decoder layers of the peft model, and the adapters' gradients equal those of the plain step."""
    import ckpt_tune
    from ckpt_tune.plan.file import Plan

    spec = PeftSpec("qlora")
    target = load_hf_target(llama_config, seq_len=SEQ, peft=spec)
    names = ("base_model.model.model.layers.0", "base_model.model.model.layers.1")
    plan = Plan(target=target.spec, device="cpu", precision="bf16-mixed", optimizer="adamw", budget_bytes=None, batch_size=2,
                grad_accum_steps=1, checkpoint=names, predicted_peak_bytes=1, predicted_recompute_fraction=0.1, seq_len=SEQ, peft=spec)

    def step(planned: bool):
        torch.manual_seed(0)
        model = target.build_fn()
        calls = dict.fromkeys(names, 0)
        for n in names:  # a pre-hook: a recompute may stop inside a module once it has what backward needs
            model.get_submodule(n).mlp.register_forward_pre_hook(lambda m, a, n=n: calls.__setitem__(n, calls[n] + 1))
        if planned and how == "patch":
            scope = {"model": model}
            exec(patch_snippet(plan, hf=True), scope)
            model = scope["model"]
        elif planned:
            ckpt_tune.apply(model, plan)
        torch.manual_seed(1)
        _amp(_hf_loss)(model, target.batch_fn(2)).backward()
        return calls, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain_calls, plain_grads = step(False)
    calls, grads = step(True)
    assert plain_calls == dict.fromkeys(names, 1)
    assert calls == dict.fromkeys(names, 2)  # forward and recompute
    assert grads.keys() == plain_grads.keys()
    assert all(".lora_" in n for n in grads)
    assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)
