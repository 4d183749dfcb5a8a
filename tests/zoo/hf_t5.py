"""transformers T5ForConditionalGeneration from a tiny config: an encoder and a decoder, two block
lists; decoder blocks cross-attend to the encoder's output; relative position bias from block 0."""

import torch
from zoo_common import gen, hf_loss, quiet_transformers, seeded

SRC, TGT, VOCAB, LAYERS = 32, 16, 1000, 2
BLOCKS = [f"encoder.block.{i}" for i in range(LAYERS)] + [f"decoder.block.{i}" for i in range(LAYERS)]


def build():
    t = quiet_transformers()
    cfg = t.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=LAYERS, num_decoder_layers=LAYERS,
                     num_heads=4, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    return seeded(lambda: t.T5ForConditionalGeneration(cfg))


def make_batch(batch_size):
    g = gen()
    return {"input_ids": torch.randint(1, VOCAB, (batch_size, SRC), generator=g),
            "labels": torch.randint(1, VOCAB, (batch_size, TGT), generator=g)}


loss_fn = hf_loss
