"""Failures of the machine, not of the user's code: said as what they are (exit 1, one line, a hint)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckpt_tune.errors import CkptTuneError, UserCodeError
from ckpt_tune.measure.loader import HOST_OOM, MISSING_KERNEL
from ckpt_tune.measure.session import user_errors

REPO = Path(__file__).resolve().parents[1]


def test_host_allocator_failure_is_not_blamed_on_the_user():
    with pytest.raises(CkptTuneError, match="ran out of host memory") as info, user_errors("searching"):
        raise RuntimeError(f"[enforce fail at alloc_cpu.cpp:117] data. {HOST_OOM}: you tried to allocate 24 GB")
    assert not isinstance(info.value, UserCodeError)
    assert "--device meta" in info.value.hint


def test_missing_cpu_kernel_is_said_with_a_way_out():
    with pytest.raises(CkptTuneError, match="this CPU cannot run the step at this precision") as info, user_errors("profiling"):
        raise RuntimeError(f"{MISSING_KERNEL} for the LSTM forward propagation primitive.")
    assert not isinstance(info.value, UserCodeError)
    assert "--precision fp32" in info.value.hint


def test_other_runtime_errors_stay_the_users():
    with pytest.raises(UserCodeError, match="the training step raised RuntimeError: shapes"), user_errors("profiling"):
        raise RuntimeError("shapes cannot be multiplied")


@pytest.mark.slow
def test_bf16_lstm_on_a_cpu_capped_at_avx2(tmp_path):
    """A bf16-mixed LSTM step on a CPU without oneDNN's bf16 LSTM kernel (capped here with
    ONEDNN_MAX_CPU_ISA=AVX2): exit 1 with the machine's reason, or exit 0 where the kernel exists."""
    target = tmp_path / "lstm_target.py"
    target.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(50, 16)
                self.lstm = nn.LSTM(16, 16, num_layers=2, batch_first=True)
                self.head = nn.Linear(16, 50)

            def forward(self, x):
                return self.head(self.lstm(self.emb(x))[0])

        def build():
            return LM()

        def make_batch(b):
            return torch.randint(0, 50, (b, 8))
    """))
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "CKPT_TUNE_NO_CONFIG": "1"}
    cmd = [sys.executable, "-m", "ckpt_tune", "profile", f"{target}:build", "--device", "cpu",
           "--precision", "bf16-mixed", "--batch-size", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert "Traceback" not in r.stderr
    if r.returncode == 0:  # this oneDNN has the kernel at that ISA
        return
    assert r.returncode == 1, r.stderr
    assert "this CPU cannot run the step at this precision" in r.stderr
    assert "--precision fp32" in r.stderr
