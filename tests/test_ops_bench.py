"""The harness's op-policy wrapper and benchmarks/peers.py's torchtitan rule (issue 16's benchmark): on a
tiny GPT with dropout they change memory and time only (loss, gradients and the random stream are
bit-identical to no checkpointing), and each keeps what it says it keeps."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests import harness

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = ["blocks.0", "blocks.1"]
CFG = {"n_layer": 2, "n_embd": 48, "n_head": 4, "block_size": 32, "vocab_size": 128}


@pytest.fixture(scope="module")
def gpt():
    spec = importlib.util.spec_from_file_location("ops_bench_test_gpt", ROOT / "examples" / "gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _step(gpt, entries=(), wrap=None):
    model = gpt.build(**CFG)
    if entries:
        harness.wrap_blocks(model, entries)
    if wrap is not None:
        wrap(model)
    return harness.one_step(model, gpt.make_batch(3, **CFG), gpt.loss_fn)


def _same(got, want):
    assert torch.equal(got["loss"], want["loss"])
    grads = {k.replace("._checkpoint_wrapped_module", ""): g for k, g in got["grads"].items()}  # torchtitan's wrapper module
    assert grads.keys() == want["grads"].keys()
    for name, g in want["grads"].items():
        assert torch.equal(grads[name], g), name
    assert torch.equal(got["rng"], want["rng"])


@pytest.mark.parametrize("policy", ["matmuls", "half-matmuls", "attention"])
@pytest.mark.parametrize("form", ["dict", "short"])
def test_policy_wrapper_changes_nothing_but_memory(gpt, policy, form):
    entries = [{"module": b, "policy": policy} if form == "dict" else f"{b}@{policy}" for b in BLOCKS]
    _same(_step(gpt, entries), _step(gpt))


def test_torchtitan_rule_changes_nothing_but_memory(gpt):
    peers = pytest.importorskip("benchmarks.peers")
    _same(_step(gpt, wrap=peers.torchtitan_op_ac(BLOCKS)), _step(gpt))


@pytest.mark.slow
def test_policies_keep_what_they_say(gpt):
    """Measured by the harness at one batch: no checkpointing > matmuls > half-matmuls > attention >=
    every block (attention keeps the attention outputs on top of the block inputs)."""
    batch = 4

    def peak(entries=()):
        return harness.measured_peak(lambda: gpt.build(**CFG), lambda b: gpt.make_batch(b, **CFG), gpt.loss_fn, batch, entries)

    none, every = peak(), peak(BLOCKS)
    keeps = {p: peak([{"module": b, "policy": p} for b in BLOCKS]) for p in ("matmuls", "half-matmuls", "attention")}
    assert none > keeps["matmuls"] > keeps["half-matmuls"] > keeps["attention"] >= every


def test_unknown_policy_is_refused(gpt):
    with pytest.raises(ValueError, match="unknown op policy"):
        harness.wrap_blocks(gpt.build(**CFG), [{"module": "blocks.0", "policy": "everything"}])
