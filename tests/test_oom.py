"""Reading saved PyTorch out-of-memory messages (tests/assets/oom, real messages from public reports)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_tune.diagnosis.oom import EXPANDABLE, classify, diagnose_oom, parse_oom, parse_size
from ckpt_tune.errors import CkptTuneError

ASSETS = Path(__file__).parent / "assets" / "oom"
MiB, GiB = 2**20, 2**30


def read(name: str) -> str:
    return (ASSETS / name).read_text()


def test_parse_size_reads_pytorch_format_size():
    assert parse_size("546.00", "MiB") == 546 * MiB
    assert parse_size("1.50", "GiB") == 3 * GiB // 2
    assert parse_size("0", "bytes") == 0
    assert parse_size("20.00", "KiB") == 20 * 1024


def test_new_message_numbers():
    m = parse_oom(read("fragmentation_vllm_engine.txt"))
    assert (m.kind, m.gpu, m.form) == ("CUDA", 0, "2.1+")
    assert m.requested == 546 * MiB
    assert m.total == round(15.77 * GiB)
    assert m.free == round(514.19 * MiB)
    assert m.allocated == round(13.73 * GiB)
    assert m.private_pools == 46 * MiB
    assert m.reserved_unallocated == round(736.86 * MiB)
    assert m.processes == ((562167, round(15.25 * GiB)),)
    assert m.this_process is None
    assert m.allowed is None


def test_legacy_message_numbers_wrapped_over_lines():
    m = parse_oom(read("legacy_fragmentation.txt"))
    assert m.form == "legacy"
    assert m.requested == 36 * MiB
    assert m.allocated == round(130.35 * MiB)
    # legacy messages give reserved in total: unallocated = reserved - allocated
    assert m.reserved_unallocated == 188 * MiB - round(130.35 * MiB)


@pytest.mark.parametrize(
    ("name", "cause"),
    [
        ("fragmentation_vllm_engine.txt", "fragmentation"),
        ("fragmentation_training_rank0.txt", "fragmentation"),
        ("legacy_fragmentation.txt", "fragmentation"),
        ("shortage_large_request.txt", "shortage"),
        ("shortage_with_fragmentation.txt", "shortage"),
        ("request_exceeds_gpu.txt", "request-exceeds-gpu"),
        ("legacy_exceeds_gpu.txt", "request-exceeds-gpu"),
    ],
)
def test_saved_messages_are_classified(name, cause):
    assert diagnose_oom(read(name)).cause == cause


def test_large_reserved_but_unallocated_is_fragmentation_and_recommends_expandable_segments():
    d = diagnose_oom(read("fragmentation_training_rank0.txt"))
    # 910.35 MiB unallocated pieces >= the 158 MiB request: the bytes exist, not in one piece
    assert d.fragmented_bytes == round(910.35 * MiB)
    assert d.fragmented_bytes >= d.message.requested
    assert d.shortfall_bytes == 0
    assert any(EXPANDABLE in r for r in d.recommendations)


def test_shortage_gives_the_missing_bytes():
    d = diagnose_oom(read("shortage_large_request.txt"))
    m = d.message
    assert d.shortfall_bytes == 16 * GiB - round(187.94 * MiB) - round(335.07 * MiB)
    assert d.shortfall_bytes == m.requested - m.free - m.reserved_unallocated
    assert not any(EXPANDABLE in r for r in d.recommendations)  # 335 MiB of pieces is not worth a word


def test_shortage_with_large_waste_mentions_both():
    d = diagnose_oom(read("shortage_with_fragmentation.txt"))
    # 22.78 GiB asked; 12.73 GiB free + 9.35 GiB pieces = 22.08 GiB: 0.70 GiB short even when joined
    assert d.shortfall_bytes == round(22.78 * GiB) - round(12.73 * GiB) - round(9.35 * GiB)
    assert "fragmentation wastes" in d.summary
    assert any(EXPANDABLE in r for r in d.recommendations)
    assert any("outside PyTorch's allocator" in line for line in d.details)


def test_free_memory_enough_is_not_called_a_shortage():
    m = parse_oom(read("fragmentation_vllm_engine.txt"))
    from dataclasses import replace

    d = classify(replace(m, free=600 * MiB, reserved_unallocated=0))
    assert d.cause == "unexplained"


def test_no_message_is_a_clear_error():
    with pytest.raises(CkptTuneError, match="no PyTorch out-of-memory message"):
        parse_oom("Traceback: ValueError: shapes do not match")


# Written in the allocator's own format (c10/cuda/CUDACachingAllocator.cpp) for a process capped with
# torch.cuda.set_per_process_memory_fraction: the "allowed" part appears only then.
CAPPED = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of "
    "79.19 GiB of which 70.00 GiB is free. 8.00 GiB allowed; Of the allocated memory 7.50 GiB is allocated by "
    "PyTorch, and 100.00 MiB is reserved by PyTorch but unallocated."
)


def test_per_process_cap():
    d = diagnose_oom(CAPPED)
    assert d.message.allowed == 8 * GiB
    # 7.50 GiB + 100 MiB reserved + 512 MiB asked = 8.10 GiB > the 8 GiB cap, with 70 GiB free on the card
    assert d.cause == "capped"
    assert "--vram 8.00GiB" in d.recommendations[0]
