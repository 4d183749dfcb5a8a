"""Budgets and devices: every budget form to the byte, errors with hints, NVML optional."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from ckpt_tune.errors import BudgetError, CkptTuneError
from ckpt_tune.measure import device as dev
from ckpt_tune.measure.device import (
    DEFAULT_CUDA_CONTEXT_BYTES,
    Budget,
    DeviceError,
    DeviceInfo,
    cuda_context_bytes,
    device_info,
    gpu_total_memory,
    parse_budget,
    parse_bytes,
    resolve_device,
)

GiB = 2**30
MiB = 2**20


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GB", 24 * 2**30),
        ("24 GB", 24 * 2**30),
        ("24gb", 24 * 2**30),
        ("24GiB", 24 * 2**30),
        ("24 gib", 24 * 2**30),
        ("24G", 24 * 2**30),
        ("24000MiB", 24000 * 2**20),
        ("512MB", 512 * 2**20),
        ("1.5TB", 3 * 2**40 // 2),
        ("1.5TiB", 3 * 2**40 // 2),
        ("4KB", 4 * 2**10),
        ("4KiB", 4 * 2**10),
        ("25769803776", 25769803776),
        ("100B", 100),
        ("0.5GiB", 2**30 // 2),
        (".25 GiB", 2**30 // 4),
        ("0.3KiB", 307),  # 0.3 * 1024 = 307.2: a fractional byte rounds down
        ("  24GB  ", 24 * 2**30),
    ],
)
def test_parse_bytes_grammar(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "is not a memory size"),
        ("abc", "is not a memory size"),
        ("-1GB", "is negative"),
        ("0", "is zero"),
        ("0GB", "is zero"),
        ("0.0001KiB", "rounds down to zero bytes"),  # 0.1024 bytes
        ("1.5", "fractional number of bytes"),
        ("24XB", "unknown unit 'XB'"),
        ("24 G B", "is not a memory size"),
        ("1e9", "is not a memory size"),
        ("nan", "is not a memory size"),
    ],
)
def test_parse_bytes_rejects_with_what_was_given_and_the_accepted_forms(text: str, says: str) -> None:
    with pytest.raises(BudgetError) as info:
        parse_bytes(text)
    assert says in info.value.message
    assert repr(text) in info.value.message
    assert "24GiB" in info.value.hint or "24 GiB" in info.value.hint


def test_budget_on_cpu_holds_nothing_back_and_says_how_it_read_gb() -> None:
    budget = parse_budget("24GB", device="cpu")
    assert budget == Budget(
        total_bytes=24 * 2**30,
        reserved_bytes=0,
        margin_bytes=0,
        context_bytes=0,
        usable_bytes=24 * 2**30,
        source="24GB read as 24 GiB (binary units) = 25769803776 bytes",
    )


def test_budget_in_binary_units_and_bytes_says_so() -> None:
    assert parse_budget("24GiB").source == "24GiB = 25769803776 bytes"
    assert parse_budget("25769803776", device="meta").source == "25769803776 bytes"


def test_budget_on_cuda_holds_back_context_and_default_five_percent() -> None:
    # On this machine CUDA is not initialized, so the context is the documented default.
    budget = parse_budget("24GB", device="cuda")
    total = 24 * 2**30
    margin = math.ceil(total * 5 / 100)  # 1288490188.8 rounds up: a margin errs on the safe side
    assert budget.total_bytes == total
    assert budget.context_bytes == DEFAULT_CUDA_CONTEXT_BYTES == 768 * 2**20
    assert budget.margin_bytes == margin == 1288490189
    assert budget.reserved_bytes == 768 * 2**20 + margin
    assert budget.usable_bytes == total - 768 * 2**20 - margin
    assert "768.0 MiB for the CUDA context (default estimate" in budget.source
    assert "default 5% on cuda" in budget.source


@pytest.mark.parametrize(
    ("margin", "expected"),
    [
        ("5%", math.ceil(24 * 2**30 * 5 / 100)),
        ("12.5%", 24 * 2**30 // 8),
        ("0.05", math.ceil(24 * 2**30 * 5 / 100)),
        (0.25, 6 * 2**30),
        ("0", 0),
        ("512MiB", 512 * 2**20),
        ("1GB", 2**30),
    ],
)
def test_margin_forms(margin: str | float, expected: int) -> None:
    budget = parse_budget("24GiB", device="meta", margin=margin)
    assert budget.margin_bytes == expected
    assert budget.context_bytes == 0
    assert budget.usable_bytes == 24 * 2**30 - expected


def test_margin_applies_per_device_index_too() -> None:
    budget = parse_budget("10GiB", device="cuda:1", margin="1GiB")
    assert budget.usable_bytes == 10 * 2**30 - 768 * 2**20 - 2**30


@pytest.mark.parametrize("margin", ["100%", "150%", "1.5", "x%", "abc", "-5%", 1.0, -0.1, float("nan")])
def test_margin_errors_name_the_margin(margin: str) -> None:
    with pytest.raises(BudgetError) as info:
        parse_budget("24GB", device="cuda", margin=margin)
    assert info.value.message.startswith(f"--margin {margin!r}")
    assert "5%" in info.value.hint


def test_budget_with_nothing_usable_is_an_error() -> None:
    # 512 MiB is less than the 768 MiB default context alone.
    with pytest.raises(BudgetError) as info:
        parse_budget("512MiB", device="cuda")
    assert "leaves nothing usable" in info.value.message
    assert "--margin" in info.value.hint
    # On cpu the same budget is fine; a margin as large as the budget is not.
    assert parse_budget("512MiB", device="cpu").usable_bytes == 512 * 2**20
    with pytest.raises(BudgetError, match="leaves nothing usable"):
        parse_budget("512MiB", device="cpu", margin="512MiB")


def test_bad_device_in_budget_is_a_device_error() -> None:
    with pytest.raises(DeviceError) as info:
        parse_budget("24GB", device="gpu")
    assert "'gpu'" in info.value.message
    assert isinstance(info.value, CkptTuneError)


def _no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with neither NVML nor CUDA, whatever machine the test runs on."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` now raises ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_without_gpu_is_a_budget_error_with_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    for text in ("auto", "AUTO", " auto "):
        with pytest.raises(BudgetError) as info:
            parse_budget(text, device="cpu")
        assert "auto" in info.value.message
        assert info.value.hint == "pass --vram explicitly, e.g. --vram 24GB"


def test_no_nvml_no_cuda_means_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_gpu(monkeypatch)
    assert gpu_total_memory() is None
    assert cuda_context_bytes() == DEFAULT_CUDA_CONTEXT_BYTES
    with pytest.raises(DeviceError):
        device_info("cuda")


def test_nvml_absent_falls_back_to_torch_mem_get_info(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Fake GPU 80GB")
    total, name, source = gpu_total_memory(0)
    assert (total, name) == (80 * 2**30, "Fake GPU 80GB")
    assert source == "torch.cuda.mem_get_info (NVML not used: pynvml not importable; install nvidia-ml-py)"
    assert gpu_total_memory(1) is None  # only cuda:0 exists
    budget = parse_budget("auto", device="cuda", margin="0%")
    assert budget.total_bytes == 80 * 2**30
    assert budget.usable_bytes == 80 * 2**30 - DEFAULT_CUDA_CONTEXT_BYTES
    assert budget.source.startswith("auto: Fake GPU 80GB total 80.0 GiB (torch.cuda.mem_get_info")


class _FakeNVMLError(Exception):
    pass


def _fake_pynvml(total: int, reserved: int, processes: list | None = None, mig: int = 0):
    """Just the NVML calls device.py makes, answering for one GPU."""
    calls: list[str] = []

    def memory_info(handle, version=None):
        if version is None:
            return types.SimpleNamespace(total=total)
        return types.SimpleNamespace(total=total, reserved=reserved)

    module = types.SimpleNamespace(
        NVMLError=_FakeNVMLError,
        nvmlMemory_v2=0x02000028,
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=lambda i: f"handle{i}",
        nvmlDeviceGetHandleByUUID=lambda uuid: f"uuid:{uuid}",
        nvmlDeviceGetName=lambda handle: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetMigMode=lambda handle: [mig, mig],
        nvmlDeviceGetMemoryInfo=memory_info,
        nvmlDeviceGetComputeRunningProcesses=lambda handle: processes or [],
    )
    return module, calls


def test_nvml_without_a_driver_falls_back_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    # pynvml installed but no driver library: nvmlInit raises, as on this CPU machine.
    fake, _ = _fake_pynvml(total=0, reserved=0)

    def no_library() -> None:
        raise _FakeNVMLError("NVML Shared Library Not Found")

    fake.nvmlInit = no_library
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_total_memory(0) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (0, 16 * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Fake GPU 16GB")
    assert gpu_total_memory(0) == (
        16 * GiB,
        "Fake GPU 16GB",
        "torch.cuda.mem_get_info (NVML not used: _FakeNVMLError: NVML Shared Library Not Found)",
    )


def test_nvml_total_leaves_out_what_the_driver_reserves(monkeypatch: pytest.MonkeyPatch) -> None:
    # nvidia-smi's H100 80GB: 81559 MiB total, of which 551 MiB reserved; CUDA sees the rest.
    fake, calls = _fake_pynvml(total=81559 * MiB, reserved=551 * MiB)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_total_memory(0) == ((81559 - 551) * MiB, "NVIDIA H100 80GB HBM3", "NVML")
    assert calls == ["init", "shutdown"]
    info = device_info("cuda")
    assert info == DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 81008 * MiB, "NVML")
    budget = parse_budget("auto", device="cuda")
    assert budget.source.startswith("auto: NVIDIA H100 80GB HBM3 total 79.1 GiB (NVML)")
    assert budget.margin_bytes == math.ceil(81008 * MiB * 5 / 100)


def test_nvml_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, _ = _fake_pynvml(total=24 * GiB, reserved=0)
    seen: list[str] = []
    fake.nvmlDeviceGetHandleByIndex = lambda i: seen.append(f"index {i}")
    fake.nvmlDeviceGetHandleByUUID = lambda u: seen.append(f"uuid {u}")
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-abc")
    gpu_total_memory(0)
    gpu_total_memory(1)
    assert seen == ["index 3", "uuid GPU-abc"]
    assert gpu_total_memory(2) is None  # no third entry, and torch sees no GPU


def test_mig_slice_is_not_read_as_the_whole_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, _ = _fake_pynvml(total=80 * GiB, reserved=0, mig=1)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_total_memory(0) is None


def test_context_measured_from_nvml_minus_reserved(monkeypatch: pytest.MonkeyPatch) -> None:
    me = types.SimpleNamespace(pid=dev.os.getpid(), usedGpuMemory=5 * GiB + 600 * MiB)
    other = types.SimpleNamespace(pid=-1, usedGpuMemory=40 * GiB)
    fake, _ = _fake_pynvml(total=80 * GiB, reserved=0, processes=[other, me])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: 5 * GiB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid="abc"))
    assert dev.cuda_context(0) == (
        600 * MiB,
        "measured: NVML process memory minus torch.cuda.memory_reserved()",
    )
    budget = parse_budget("24GiB", device="cuda", margin="0")
    assert budget.context_bytes == 600 * MiB
    assert budget.usable_bytes == 24 * GiB - 600 * MiB


def test_context_falls_back_when_nvml_cannot_see_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, _ = _fake_pynvml(total=80 * GiB, reserved=0, processes=[])  # as in a PID namespace
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(uuid="abc"))
    size, how = dev.cuda_context(0)
    assert size == DEFAULT_CUDA_CONTEXT_BYTES
    assert "does not report this process" in how


def test_resolve_device_on_this_machine() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None) == expected
    assert resolve_device("auto") == expected
    assert resolve_device("cpu") == "cpu"
    assert resolve_device(" META ") == "meta"


@pytest.mark.parametrize("requested", ["cuda", "cuda:0", "cuda:3"])
def test_resolve_cuda_without_cuda_says_use_cpu_or_meta(
    monkeypatch: pytest.MonkeyPatch, requested: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError) as info:
        resolve_device(requested)
    assert repr(requested) in info.value.message
    assert info.value.hint == "use --device cpu or --device meta"


def test_resolve_cuda_index_past_the_last_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(DeviceError, match=r"sees 2 CUDA device\(s\)"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("requested", ["gpu", "tpu", "cuda:x", "cpu:0", "", "mps"])
def test_resolve_rejects_unknown_devices(requested: str) -> None:
    with pytest.raises(DeviceError) as info:
        resolve_device(requested)
    assert "auto, cpu, cuda, cuda:N or meta" in info.value.message


def test_device_info_cpu_and_meta() -> None:
    assert device_info("cpu") == DeviceInfo("cpu", "cpu", None, "n/a")
    assert device_info("meta") == DeviceInfo("meta", "meta", None, "n/a")


@pytest.mark.gpu
def test_gpu_total_memory_matches_cuda_runtime() -> None:
    # NVML's total less its driver-reserved part should be what cudaMemGetInfo calls total.
    total, name, source = gpu_total_memory(0)
    _free, cuda_total = torch.cuda.mem_get_info(0)
    assert abs(total - cuda_total) <= cuda_total // 100, (
        f"{source}: {total} bytes vs cudaMemGetInfo total {cuda_total} bytes on {name}"
    )
    assert device_info("cuda:0").total_bytes == total


@pytest.mark.gpu
def test_context_measured_on_a_live_gpu_is_plausible() -> None:
    torch.ones(1, device="cuda")  # creates the context
    size, how = dev.cuda_context(0)
    # When measured, a CUDA 12 context is a few hundred MiB; the fallback is the default.
    assert 100 * MiB <= size <= 4 * GiB, f"{size} bytes ({how})"
