"""A Hugging Face `GPT2LMHeadModel` built from a small `GPT2Config`, with random weights.

Nothing is downloaded: the model comes from a config, so this runs offline. A target for `ckpt-tune`:

    ckpt-tune profile examples/hf_gpt2.py:build --device cpu --batch-size 8

It needs the optional `transformers` dependency (`pip install 'ckpt-tune[hf]'`). Importing this file
works without it; `build()` says what to install. The key-value cache is off (`use_cache=False`):
it is useless in training and Hugging Face disables it under checkpointing anyway (docs/design.md §5).
"""

import torch
from torch import nn

# Small enough for a CPU step in well under a second; the names are GPT2Config's own.
N_LAYER = 4  # transformer blocks (`transformer.h.0` .. `transformer.h.3`)
N_EMBD = 256  # width of the residual stream
N_HEAD = 4  # attention heads per block
VOCAB_SIZE = 8192  # token ids; the logits are [B, T, VOCAB_SIZE]
N_POSITIONS = 256  # maximum sequence length, and the T that make_batch uses

_MISSING = "examples/hf_gpt2.py needs transformers: pip install 'ckpt-tune[hf]'"


def build() -> nn.Module:
    """A randomly initialised GPT-2 LM head model; the same weights on every call (seed 0).

    Raises RuntimeError with an install hint when `transformers` is not importable.
    """
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as exc:
        raise RuntimeError(_MISSING) from exc
    config = GPT2Config(
        n_layer=N_LAYER,
        n_embd=N_EMBD,
        n_head=N_HEAD,
        vocab_size=VOCAB_SIZE,
        n_positions=N_POSITIONS,
        use_cache=False,
        # GPT-2's special token id 50256 lies outside this vocabulary; use the last id instead.
        bos_token_id=VOCAB_SIZE - 1,
        eos_token_id=VOCAB_SIZE - 1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
    # transformers infers the loss from the class name, finds none for "GPT2LMHeadModel" and logs a
    # warning before falling back to this same causal-LM loss; naming it keeps the output quiet.
    model.loss_type = "ForCausalLM"
    return model


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    """`{"input_ids", "labels"}`, both LongTensor [batch_size, N_POSITIONS].

    The labels equal the inputs: GPT2LMHeadModel shifts them by one position itself.
    """
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB_SIZE, (batch_size, N_POSITIONS), generator=g)  # [B, T]
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own next-token cross-entropy (`output.loss`)."""
    return model(**batch).loss
