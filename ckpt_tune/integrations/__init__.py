"""Where people train: a plan applied to a Hugging Face `Trainer` (`hf.py`), a Lightning callback that
plans at fit start (`lightning.py`), and a pytest marker that bounds a test's peak memory
(`pytest_plugin.py`). Each module imports its framework on use; `import ckpt_tune.integrations` needs
none of them."""
