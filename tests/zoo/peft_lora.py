"""peft LoRA (r 4, dropout 0.1, on q_proj and v_proj) over a tiny Llama causal LM: the base is frozen,
only the adapters train."""

from zoo_common import hf_loss, quiet_transformers, seeded, tokens

SEQ, VOCAB, LAYERS = 32, 1000, 3
BLOCKS = [f"base_model.model.model.layers.{i}" for i in range(LAYERS)]


def build():
    t = quiet_transformers()
    import peft

    cfg = t.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return seeded(lambda: peft.get_peft_model(t.LlamaForCausalLM(cfg), lora))


def make_batch(batch_size):
    return tokens(batch_size, SEQ, VOCAB)


loss_fn = hf_loss
