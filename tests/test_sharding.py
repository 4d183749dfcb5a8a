"""Per-GPU arithmetic of sharding, 8-bit optimizer state, LoRA and offload: numbers written by hand."""

from __future__ import annotations

import pytest

from ckpt_tune.errors import CkptTuneError
from ckpt_tune.tune.memory_model import BlockTerms, Terms
from ckpt_tune.tune.sharding import (
    LoraPlan,
    Moment,
    accumulate_moment,
    check_shard,
    eight_bit_state_bytes,
    lora_moment,
    offload_moment,
    peak_of,
    per_gpu_terms,
    shard_moment,
    static_per_gpu,
)

P, G, OPT = 4_000, 4_000, 8_000  # fp32 weights, gradients, AdamW state (2 × fp32) of 1000 values


@pytest.mark.parametrize(
    ("shard", "expect"),
    [
        ("zero1", (P, G, OPT // 4, 0)),
        ("zero2", (P, G // 4, OPT // 4, 0)),
        ("zero3", (P // 4, G // 4, OPT // 4, 640)),
        ("fsdp", (P // 4, G // 4, OPT // 4, 640)),
    ],
)
def test_static_per_gpu_divides_what_each_stage_shards(shard, expect):
    s = static_per_gpu(P, G, OPT, world_size=4, shard=shard, gathered_bytes=640)
    assert (s.params, s.grads, s.optimizer, s.gathered) == expect
    assert s.total == sum(expect)


def test_static_per_gpu_rounds_shards_up():
    s = static_per_gpu(10, 10, 10, world_size=4, shard="zero3")
    assert (s.params, s.grads, s.optimizer) == (3, 3, 3)  # ceil(10 / 4): the last rank pads


def test_check_shard_needs_both_flags():
    assert check_shard(None, None) == (1, "none")
    assert check_shard(8, "fsdp") == (8, "fsdp")
    with pytest.raises(CkptTuneError, match="without a sharding stage"):
        check_shard(8, None)
    with pytest.raises(CkptTuneError, match="needs --world-size"):
        check_shard(None, "zero3")
    with pytest.raises(CkptTuneError, match="unknown --shard"):
        check_shard(2, "zero4")


def moment(phase, params=P, grads=0, optimizer=OPT, activations=0, other=0, modules=()):
    return Moment(params, grads, optimizer, activations, other, phase, phase, 0.0, modules)


def test_shard_moment_gathers_one_unit_in_forward_and_backward_only():
    fwd = moment("forward", activations=3_000, other=100)
    step = moment("step", grads=G, other=500)
    f = shard_moment(fwd, 2, "zero3", gathered_bytes=1_000)
    s = shard_moment(step, 2, "zero3", gathered_bytes=1_000)
    assert f.total == P // 2 + 1_000 + OPT // 2 + 3_000 + 100
    assert s.total == P // 2 + G // 2 + OPT // 2 + 500  # the step works on shards: nothing gathered
    assert shard_moment(fwd, 1, "none") is fwd


def test_peak_moves_when_the_step_shrinks():
    # today the optimizer step is the peak; ZeRO-2 over 4 cuts its gradients and state, and forward becomes the peak
    fwd = moment("forward", activations=9_000)
    step = moment("step", grads=G, other=6_000)
    assert peak_of([fwd, step]) is step  # 22_000 against 21_000
    after = [shard_moment(m, 4, "zero2") for m in (fwd, step)]
    assert peak_of(after).phase == "forward"
    assert peak_of(after).total == P + OPT // 4 + 9_000  # the step is down to P + G/4 + OPT/4 + 6_000


def test_per_gpu_terms_replaces_static_only():
    blk = BlockTerms((1, 1, 1, 1), (2, 2, 2, 2), (3, 3, 3, 3))
    t = Terms(1, ("b0",), static=P + OPT, base=10, fixed=20, blocks=(blk,))
    out = per_gpu_terms(t, P, OPT, world_size=4, shard="zero3", gathered_bytes=500)
    assert out.static == P // 4 + OPT // 4 + 500
    assert (out.base, out.fixed, out.blocks) == (t.base, t.fixed, t.blocks)


def test_accumulation_keeps_the_summed_gradients_live_through_forward_and_backward():
    fwd = moment("forward", activations=1_000)
    bwd = moment("backward", grads=1_500, activations=400)
    step = moment("step", grads=G)
    assert accumulate_moment(fwd, G, in_flight=300).total == fwd.total + G
    # backward: the sum, plus one node's new gradients before they are added in
    assert accumulate_moment(bwd, G, in_flight=300).total == bwd.total - 1_500 + G + 300
    assert accumulate_moment(step, G, in_flight=300) == step


def test_eight_bit_state_follows_the_bitsandbytes_layout():
    # AdamW: two states. 8192 values: 2 × (8192 one-byte values + 32 fp32 absmax) + 2 shared 256-entry qmaps
    assert eight_bit_state_bytes([8192], "adamw") == 2 * (8192 + 4 * 32) + 2 * 1024
    # under 4096 values the state stays 32-bit: 2 × 4 bytes per value, no qmap
    assert eight_bit_state_bytes([100], "adamw") == 2 * 4 * 100
    # a 4097-value tensor has 17 blocks of 256
    assert eight_bit_state_bytes([4097], "sgd-momentum") == 4097 + 4 * 17 + 1024
    assert eight_bit_state_bytes([8192], "sgd") == 0
    # 8 bytes per value become about 2: the remedy's claim
    n = 1 << 20
    assert eight_bit_state_bytes([n], "adamw") / (8 * n) == pytest.approx(2 / 8, rel=0.02)


def test_lora_moment_keeps_adapters_only():
    plan = LoraPlan(
        rank=4,
        adapted=("blk.fc",),
        frozen_saves=("head",),
        adapter_param_bytes=400,
        adapter_saves=(("blk.fc", 64, True),),
        branch_grad_bytes=512,
        trainable_param_bytes=P,
        optimizer_bytes=OPT,
    )
    fwd = moment("forward", activations=3_000, other=50, modules=(("blk.fc", 2_000), ("head", 1_000)))
    out = lora_moment(fwd, plan)
    assert out.params == P + 400
    assert out.grads == 0
    assert out.optimizer == OPT * 400 // P  # state only for the adapters' 400 bytes
    assert out.activations == 3_000 - 1_000 + 64  # head's input no longer saved; the rank-4 intermediate added
    bwd = moment("backward", grads=1_000, activations=2_000, other=300, modules=(("blk.fc", 2_000),))
    b = lora_moment(bwd, plan)
    assert b.grads == 400  # at most the adapters' gradients
    assert b.activations == 2_000 + 64
    assert b.other == 300 + 512  # the input gradient from the second branch
    step = moment("step", grads=G, other=1_000)
    s = lora_moment(step, plan)
    assert s.grads == 400
    assert s.other == 1_000 * 400 // P  # the step's scratch scales with what is trained


def test_offload_keeps_one_block_of_activations():
    m = moment("forward", activations=10_000, other=7)
    assert offload_moment(m, 2_500).total == P + OPT + 2_500 + 7
    assert offload_moment(m, 20_000) == m


def test_moments_from_a_profile_record_alone():
    from ckpt_tune.measure.profiler import profile_model
    from ckpt_tune.tune.sharding import moments_from_profile
    from tests.fixtures.models import ZOO

    fx = ZOO["mlp_blocks"]
    prof = profile_model(fx.build(), fx.make_batch, fx.loss_fn, 8, scaling=False)
    moments = moments_from_profile(prof)
    assert peak_of(moments).total == prof.peak_bytes  # the peak comes from the breakdown, exactly
    b = prof.breakdown
    assert peak_of(moments).activations == b.activations
    phases = {m.phase for m in moments}
    assert {"start", "forward", "backward", "step"} <= phases
    for m in moments:
        assert m.total <= prof.peak_bytes
        assert m.params == prof.param_bytes
