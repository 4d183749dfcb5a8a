"""LoRA and QLoRA across Hugging Face architectures: ckpt-tune's peak against the allocator's.

For each of 14 decoder architectures transformers builds (small random configs: 2 layers, width 128,
vocabulary 1000, sequence 64, batch 2), `--peft qlora` and `--peft lora` under bf16 autocast:

- harness: `tests/harness.measured_peak(count_build=True)`, the CPU allocator's events read by
  torch.profiler over the build and two training iterations (independent of ckpt-tune's code);
- cpu: `ckpt-tune profile --device cpu`'s peak;
- meta: `ckpt-tune profile --device meta`'s peak (fake tensors, CUDA's 512 B blocks: above the CPU's
  exact bytes by the rounding).

Mixtral's fused experts take peft adapters only without dropout: it runs with `--lora-dropout 0`.

    .venv/bin/python benchmarks/peft_archs.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import md_table, write_results  # noqa: E402
from ckpt_tune.measure import session  # noqa: E402
from ckpt_tune.measure.hf import load_hf_target  # noqa: E402
from ckpt_tune.plan.finetune import PeftSpec  # noqa: E402
from tests import harness  # noqa: E402

BASE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256}
ARCHS = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {"head_dim": 32}, "gemma": {"head_dim": 32}, "phi": {},
    "gpt_neox": {}, "olmo": {}, "stablelm": {}, "opt": {"ffn_dim": 256, "word_embed_proj_dim": 128},
    "falcon": {"new_decoder_architecture": False}, "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt2": None,  # its own names
    "phi3": {"pad_token_id": 0},
}
GPT2 = {"n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 256, "vocab_size": 1000}
SEQ, BATCH = 64, 2


def _amp_loss(model, batch):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(**batch).loss


def _config(arch: str, folder: Path) -> Path:
    data = dict(GPT2) if ARCHS[arch] is None else {**BASE, **ARCHS[arch]}
    data["model_type"] = arch
    path = folder / f"{arch}.json"
    path.write_text(json.dumps(data))
    return path


def main() -> None:
    warnings.filterwarnings("ignore")
    rows, records = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            path = _config(arch, Path(tmp))
            for method in ("qlora", "lora"):
                spec = PeftSpec(method, dropout=0.0 if arch == "mixtral" else 0.05)
                t0 = time.perf_counter()
                rec = {"arch": arch, "method": method, "peft": spec.to_data()}
                try:
                    target = load_hf_target(path, seq_len=SEQ, peft=spec)
                    target.build_fn()  # one-time tables (bitsandbytes' code books) outside the measurement
                    rec["harness"] = harness.measured_peak(target.build_fn, target.batch_fn, _amp_loss, BATCH, count_build=True)
                    for device in ("cpu", "meta"):
                        settings = session.Settings(device=device, precision="bf16-mixed", hf_config=str(path), seq_len=SEQ, peft=spec)
                        rec[device] = session.profile(None, batch_size=BATCH, settings=settings, scaling=False).peak_bytes
                except Exception as e:  # a row that fails is reported as failing, never dropped
                    rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                rec["seconds"] = round(time.perf_counter() - t0, 1)
                records.append(rec)
                if "error" in rec:
                    rows.append([arch, method, "-", "-", "-", "-", "-", rec["error"]])
                else:
                    h = rec["harness"]
                    rows.append([arch, method, f"{h:,}", f"{rec['cpu']:,}", f"{rec['cpu'] - h:+,}", f"{rec['meta']:,}",
                                 f"{(rec['meta'] - h) / h:+.3%}", ""])
                print(rows[-1], file=sys.stderr, flush=True)
    ok = [r for r in records if "error" not in r]
    exact = sum(r["cpu"] == r["harness"] for r in ok)
    worst_meta = max(((r["meta"] - r["harness"]) / r["harness"] for r in ok), default=0.0)
    summary = (f"{len(ok)} of {len(records)} runs recorded; `--device cpu` equal to the allocator's peak, to the byte, in "
               f"{exact} of {len(ok)}; `--device meta` above it by at most {worst_meta:.3%} (CUDA's 512 B blocks).")
    body = "\n".join([
        __doc__.split("\n\n    .venv")[0].strip(), "", "## Summary", "", summary, "", "## Runs", "",
        md_table(["architecture", "peft", "harness B", "cpu B", "cpu - harness", "meta B", "meta vs harness", "error"], rows),
    ])
    write_results("peft_archs", "LoRA and QLoRA across architectures: peak vs the allocator", {"runs": records, "summary": summary}, body)


if __name__ == "__main__":
    main()
