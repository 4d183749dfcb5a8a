"""Every shipped Hugging Face config profiles under `--device meta`, as shipped and cut to the keys
transformers cannot build without (docs/design.md §3): `ckpt-tune profile --hf-config FILE --device meta`.

Each run is its own process (a 70B-parameter fake model stays out of the test process). Fake steps of
the 7B-70B configs take seconds to a minute on 2 cores, so those run at a short sequence and are slow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.json"))
# torchvision, when installed, is imported by transformers: through tests/torchvision_compat.py
_MAIN = (
    "import importlib.util, sys\n"
    "if importlib.util.find_spec('torchvision') is not None:\n"
    "    import tests.torchvision_compat\n"
    "from ckpt_tune.cli import main\n"
    "main(sys.argv[1:])\n"
)


_ENV = {**os.environ, "CKPT_TUNE_NO_CONFIG": "1"}  # no project configuration from the checkout


def _profile(config: Path, seq_len: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", _MAIN, "profile", "--hf-config", str(config), "--device", "meta"]
    cmd += ["--seq-len", str(seq_len), "--batch-size", "1"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=_ENV)


def _minimal(config: Path, tmp_path: Path) -> Path:
    """The config with every optional key removed: transformers builds from model_type alone."""
    out = tmp_path / f"minimal-{config.name}"
    out.write_text(json.dumps({"model_type": json.loads(config.read_text())["model_type"]}))
    return out


def _large(config: Path) -> bool:
    return json.loads(config.read_text()).get("hidden_size", 0) >= 1024 or "gpt2" not in config.name


def _marks(config: Path, form: str) -> list:
    """The docs' Llama-2-7B and the tiny GPT-2 as shipped run in `make test`; the other configs, and
    every config cut to `model_type` (a default-sized model: tens of seconds each on 2 cores), with
    `make test-heavy`."""
    if form == "shipped" and (not _large(config) or config.stem == "llama-2-7b"):
        return [pytest.mark.slow] if _large(config) else []
    return [pytest.mark.slow, pytest.mark.heavy]


@pytest.mark.hf
@pytest.mark.parametrize(
    ("config", "form"),
    [pytest.param(c, f, id=f"{c.stem}-{f}", marks=_marks(c, f)) for c in CONFIGS for f in ("shipped", "minimal")],
)
def test_shipped_hf_config_profiles_under_fake_tensors(config, form, tmp_path):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    path = config if form == "shipped" else _minimal(config, tmp_path)
    # the default model of a minimal config (e.g. Llama's) is 7B-sized: short sequences keep it seconds
    seq_len = 128 if form == "shipped" and not _large(config) else 16
    p = _profile(path, seq_len)
    assert p.returncode == 0, f"{path.name}: exit {p.returncode}\n{p.stderr[-2000:]}"
    assert "Traceback" not in p.stderr
    assert "peak" in p.stdout + p.stderr


def test_a_model_fake_tensors_cannot_run_exits_1_with_a_hint(tmp_path):
    """A data-dependent op (`.item()`) under `--device meta`: one message and a hint, no traceback."""
    target = tmp_path / "item_model.py"
    target.write_text(
        "import torch\n"
        "from torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        y = self.lin(x)\n"
        "        return (y * y.max().item()).sum()\n"
        "def build():\n"
        "    return M()\n"
        "def make_batch(b):\n"
        "    return torch.randn(b, 4)\n"
    )
    cmd = [sys.executable, "-c", _MAIN, "profile", f"{target}:build", "--device", "meta"]
    p = subprocess.run([*cmd, "--batch-size", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=_ENV)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "Traceback" not in p.stderr + p.stdout
    assert "fake tensors cannot run this model: aten._local_scalar_dense" in p.stderr
    assert "use --device cpu on a smaller config" in p.stderr
