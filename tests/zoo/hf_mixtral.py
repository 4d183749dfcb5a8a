"""transformers MixtralForCausalLM from a tiny config: 3 decoder layers, each a sparse MoE of 4 experts
with top-2 routing (which tokens reach which expert depends on the data) and the router's aux loss."""

from zoo_common import hf_loss, quiet_transformers, seeded, tokens

SEQ, VOCAB, LAYERS = 32, 1000, 3
# the decoder layers; the experts inside each are not blocks of a chain
BLOCKS = [f"model.layers.{i}" for i in range(LAYERS)]


def build():
    t = quiet_transformers()
    cfg = t.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                          router_aux_loss_coef=0.02, use_cache=False)
    return seeded(lambda: t.MixtralForCausalLM(cfg))


def make_batch(batch_size):
    return tokens(batch_size, SEQ, VOCAB)


loss_fn = hf_loss
