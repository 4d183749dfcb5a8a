from ckpt_tune.cli import entry

entry()
