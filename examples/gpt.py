"""A GPT-2-style decoder-only transformer, written after nanoGPT (Karpathy, `model.py`).

This is the model `make demo` profiles and tunes: a target for `ckpt-tune`, e.g.

    ckpt-tune profile examples/gpt.py:build --device cpu --batch-size 16

The default config (3.5M parameters, 13 MiB of fp32 weights) is sized so that one AdamW step at
batch 16 takes about a third of a second on a 2-core CPU while the tensors saved for backward (about
200 MiB) are some fifteen times the weights: the regime where gradient checkpointing pays off.
`build(n_layer=2)` and friends override config fields.
"""

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 128  # maximum sequence length; also the T that make_batch uses
    vocab_size: int = 4096  # number of token ids; the logits are [B, T, vocab_size]
    n_layer: int = 6  # number of transformer blocks in `blocks`
    n_head: int = 6  # attention heads per block; n_embd must divide evenly by it
    n_embd: int = 192  # width of the residual stream (C)
    dropout: float = 0.1  # dropout probability after the embeddings and after each residual projection
    # dropout on the attention probabilities; nonzero makes CPU attention fall back from the fused
    # kernel, which saves O(T) per head, to the math path, which saves the O(T^2) probabilities
    attn_dropout: float = 0.0
    bias: bool = True  # bias in Linear and LayerNorm layers, as in GPT-2


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused q/k/v projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd={config.n_embd} is not divisible by n_head={config.n_head}")
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.attn_dropout = config.attn_dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x [B, T, C]
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # [B, nh, T, hs]
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # [B, nh, T, hs]
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # [B, nh, T, hs]
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_dropout if self.training else 0.0, is_causal=True
        )  # [B, nh, T, hs]
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # [B, T, C]
        return self.resid_dropout(self.c_proj(y))  # [B, T, C]


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide, GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gelu(self.c_fc(x))  # [B, T, 4C]
        return self.dropout(self.c_proj(x))  # [B, T, C]


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # [B, T, C]
        return x + self.mlp(self.ln_2(x))  # [B, T, C]


class GPT(nn.Module):
    """Token and position embeddings, a stack of `Block`s, a final LayerNorm and a tied LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017, as in GPT-2): one [vocab, C] matrix serves both ends.
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer) so the stream's variance
        # does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.size()  # [B, T]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, dtype=torch.long, device=idx.device)  # [T]
        x = self.drop(self.wte(idx) + self.wpe(pos))  # [B, T, C]
        for block in self.blocks:
            x = block(x)  # [B, T, C]
        x = self.ln_f(x)  # [B, T, C]
        return self.lm_head(x)  # [B, T, vocab_size]


def _config(overrides: dict[str, object]) -> GPTConfig:
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"unknown GPTConfig field(s) {unknown}; known: {sorted(known)}")
    return GPTConfig(**overrides)  # type: ignore[arg-type]


def build(**overrides: object) -> GPT:
    """The default GPT; keyword arguments override `GPTConfig` fields, e.g. `build(n_layer=2)`.

    Weights are initialised from a fixed seed in a private generator scope, so two calls give the
    same model and the caller's random stream is left as it was.
    """
    config = _config(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT(config)


def make_batch(batch_size: int, **overrides: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids `(idx, targets)`, both LongTensor [batch_size, block_size].

    `targets` is `idx` shifted left by one, as in next-token prediction. Pass the same overrides as
    to `build()` when they change `vocab_size` or `block_size`.
    """
    config = _config(overrides)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # [B, T], [B, T]


def loss_fn(model: GPT, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over all B*T positions."""
    idx, targets = batch
    logits = model(idx)  # [B, T, vocab_size]
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
