"""Cross-check against the published activation formula for transformer layers.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 1): one
GPT layer without flash attention saves 34·s·b·h + 5·a·s²·b bytes in 16-bit, counting 1-byte dropout
masks. On CPU PyTorch's dropout keeps its mask in the input's dtype (2 bytes, where CUDA's fused kernel
keeps 1), which adds one byte for each of the three masks: s·b·h (attention output), s·b·h (MLP output)
and a·s²·b (attention probabilities). LayerNorm's mean and rstd, which the formula leaves out, add
2 LayerNorms · 2 tensors · s·b rows · 2 bytes (kept in bf16 on CPU).
"""

from __future__ import annotations

import pytest

from ckpt_tune.measure.profiler import profile_model
from ckpt_tune.measure.runner import StepSettings

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

pytestmark = pytest.mark.hf


@pytest.mark.parametrize(("h", "a", "s", "b"), [(256, 4, 128, 2), (128, 8, 64, 3)])
def test_gpt2_layer_saves_what_korthikanti_counts(h, a, s, b):
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=h, n_head=a, vocab_size=512, n_positions=s, activation_function="gelu",
        attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1, use_cache=False, bos_token_id=0, eos_token_id=0,
    )

    def build():
        torch.manual_seed(0)
        m = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager")
        m.loss_type = "ForCausalLM"
        return m

    def make_batch(n):
        x = torch.randint(0, 512, (n, s), generator=torch.Generator().manual_seed(0))
        return {"input_ids": x, "labels": x}

    prof = profile_model(build(), make_batch, lambda m, batch: m(**batch).loss, b,
                         settings=StepSettings(precision="bf16"), scaling=False)
    formula = 34 * s * b * h + 5 * a * s * s * b
    cpu_masks = 2 * s * b * h + a * s * s * b
    ln_stats = 2 * 2 * s * b * 2
    for layer in ("transformer.h.0", "transformer.h.1"):
        got = next(m.subtree_activation_bytes for m in prof.modules if m.name == layer)
        assert got == formula + cpu_masks + ln_stats, f"{layer}: {got} vs {formula} + {cpu_masks} + {ln_stats}"
