import ckpt_tune_no_such_module  # noqa: F401


def build():
    return None
