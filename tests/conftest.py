"""Shared test set-up: tests marked `gpu` are skipped where torch sees no CUDA device; `main` and `run`
run `ckpt-tune check` in this process."""

from __future__ import annotations

import sys

import pytest
import torch

from ckpt_tune.measure.loader import MISSING_KERNEL


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `keywords`: a param id "gpu" is one
            item.add_marker(skip)


# oneDNN builds CPU kernels for the instruction set it finds: without AVX-512 (bf16) there is no bf16
# LSTM primitive, and the allocator ground truth of such a step cannot be produced on this machine.
# MISSING_KERNEL is oneDNN's message, as the tool itself recognises it (measure/loader.py).


@pytest.fixture
def require_cpu_kernel():
    """`require_cpu_kernel(fn, what)`: run fn(); skip the test, with the reason, when this CPU has no
    oneDNN kernel for it (e.g. bf16 LSTM on an AVX2 CPU, or under ONEDNN_MAX_CPU_ISA=AVX2)."""

    def check(fn, what: str) -> None:
        try:
            fn()
        except RuntimeError as e:
            if MISSING_KERNEL not in str(e):
                raise
            pytest.skip(f"this CPU has no oneDNN kernel for {what}: {str(e).splitlines()[0][:120]}")

    return check


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of tiny models: thread start-up costs more than it saves on a shared
    2-core machine. Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -- `ckpt-tune check` run in this process (tests/test_check.py, tests/test_check_sharded.py) --------------


@pytest.fixture(scope="module")
def main():
    """cli.main with the `check` command registered (cli.py adds it with one line; until then, here,
    and taken out again afterwards so other tests see cli.app as it is)."""
    from ckpt_tune import cli
    from ckpt_tune.cli import check as check_cli

    added = []
    if not any(getattr(c.callback, "__name__", "") == "check" for c in cli.app.registered_commands):
        before = list(cli.app.registered_commands)
        check_cli.register(cli.app)
        added = [c for c in cli.app.registered_commands if c not in before]
    yield cli.main
    for c in added:
        cli.app.registered_commands.remove(c)


@pytest.fixture
def run(main, monkeypatch, capsys):
    """Run `ckpt-tune ARGS...` in this process; returns (exit code, stdout, stderr)."""

    def _run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["ckpt-tune", *args])
        with pytest.raises(SystemExit) as exc:
            main()
        cap = capsys.readouterr()
        return exc.value.code, cap.out, cap.err

    return _run
