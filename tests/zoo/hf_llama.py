"""transformers LlamaForCausalLM from a tiny config: 3 decoder layers, grouped-query attention (4 heads, 2 KV)."""

from zoo_common import hf_loss, quiet_transformers, seeded, tokens

SEQ, VOCAB, LAYERS = 32, 1000, 3
BLOCKS = [f"model.layers.{i}" for i in range(LAYERS)]


def build():
    t = quiet_transformers()
    cfg = t.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False)
    return seeded(lambda: t.LlamaForCausalLM(cfg))


def make_batch(batch_size):
    return tokens(batch_size, SEQ, VOCAB)


loss_fn = hf_loss
