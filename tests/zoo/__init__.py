"""The conformance zoo: models written by others (torchvision, timm, transformers, peft, plain torch),
each a ckpt-tune target file with a hand-written list of its innermost repeated blocks (see members.py)."""
