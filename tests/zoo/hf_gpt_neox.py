"""transformers GPTNeoXForCausalLM from a tiny config: 3 layers, parallel residual, partial rotary, dropout 0.1."""

from zoo_common import hf_loss, quiet_transformers, seeded, tokens

SEQ, VOCAB, LAYERS = 32, 1000, 3
BLOCKS = [f"gpt_neox.layers.{i}" for i in range(LAYERS)]


def build():
    t = quiet_transformers()
    cfg = t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                          num_attention_heads=4, max_position_embeddings=128, rotary_pct=0.25,
                          hidden_dropout=0.1, attention_dropout=0.1, use_cache=False)
    return seeded(lambda: t.GPTNeoXForCausalLM(cfg))


def make_batch(batch_size):
    return tokens(batch_size, SEQ, VOCAB)


loss_fn = hf_loss
