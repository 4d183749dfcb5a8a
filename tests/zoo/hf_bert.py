"""transformers BertForSequenceClassification from a tiny config (random weights, no download):
2 encoder layers, hidden 64, dropout 0.1, padded batches with an attention mask."""

import torch
from zoo_common import gen, hf_loss, quiet_transformers, seeded

SEQ, VOCAB, LAYERS = 32, 1000, 2
BLOCKS = [f"bert.encoder.layer.{i}" for i in range(LAYERS)]


def build():
    t = quiet_transformers()
    cfg = t.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                       intermediate_size=128, max_position_embeddings=64, num_labels=3)
    return seeded(lambda: t.BertForSequenceClassification(cfg))


def make_batch(batch_size):
    g = gen()
    ids = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    mask = torch.ones(batch_size, SEQ, dtype=torch.long)
    mask[::2, SEQ // 2:] = 0  # every other sample padded to half length
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (batch_size,), generator=g)}


loss_fn = hf_loss
