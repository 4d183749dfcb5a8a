"""Shared test set-up: tests marked `gpu` are skipped where torch sees no CUDA device."""

from __future__ import annotations

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
