"""Which device, how much memory: parse `--vram` / `--margin` into a `Budget`, and read the GPU.

Units are binary throughout: `GB` is read as GiB, because a "24 GB" card holds about 24 GiB and users
type the number on the box. NVML (`pynvml`, from the `nvidia-ml-py` distribution) is optional and
imported lazily; without it the GPU is read through `torch.cuda.mem_get_info`. Every number says
where it came from (`source`), so a report can show how the budget was read and what was held back.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from fractions import Fraction

import torch

from ckpt_tune.errors import BudgetError, CkptTuneError

# A typical CUDA 12 context of a PyTorch training process, used when it cannot be measured (CUDA not
# yet initialized, or NVML cannot see this process, as in a container's PID namespace). With lazy
# module loading (default since CUDA 11.7) a bare context is ~300-400 MiB (pytorch#107667, #109888);
# the cuBLAS/cuDNN kernels a training step loads lazily add a few hundred MiB more on Ampere/Hopper.
# 768 MiB sits in the 500 MiB-1 GiB range such processes show in nvidia-smi above memory_reserved().
DEFAULT_CUDA_CONTEXT_BYTES = 768 * 2**20

# Default --margin on CUDA: room for caching-allocator fragmentation (reserved above allocated) and
# for what the context estimate gets wrong. CPU and meta peaks are exact allocator counts: no margin.
DEFAULT_CUDA_MARGIN = Fraction(5, 100)

ACCEPTED_BUDGETS = "24GB, 24 GiB, 24000MiB, 512MB, 1.5TB, 0.5GiB, 25769803776 (bytes) or auto"
ACCEPTED_MARGINS = "5%, 0.05 (a share of the budget) or 512MiB (a size)"
ACCEPTED_DEVICES = "auto, cpu, cuda, cuda:N or meta"

# Unit (lower-cased) -> exponent of 1024. Decimal-looking names are read as binary (module docstring).
_UNIT_POWERS = {"": 0, "b": 0} | {
    unit: power
    for power, prefix in enumerate("kmgt", start=1)
    for unit in (prefix, f"{prefix}b", f"{prefix}ib")
}
_BINARY_NAMES = {1: "KiB", 2: "MiB", 3: "GiB", 4: "TiB"}
_BYTES_RE = re.compile(r"^(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)$", re.IGNORECASE)


class DeviceError(CkptTuneError):
    """The requested device does not exist on this machine, or the device string is malformed."""


@dataclass(frozen=True)
class Budget:
    total_bytes: int  # what the user asked for (or the GPU's total with "auto")
    reserved_bytes: int  # held back from total: context_bytes + margin_bytes
    margin_bytes: int  # the --margin share (default 5% on cuda, 0 on cpu/meta)
    context_bytes: int  # estimated or measured CUDA context (0 on cpu/meta)
    usable_bytes: int  # total - context - margin: what a plan's peak (allocated bytes) may reach
    source: str  # how the total was read, then what was held back and why


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cpu" | "cuda" | "meta"
    name: str  # "cpu", "meta", or the GPU name
    total_bytes: int | None  # memory CUDA can allocate on the GPU; None for cpu/meta
    source: str  # "NVML..." / "torch.cuda.mem_get_info..." / "n/a"


def _format_bytes(n: int) -> str:
    """Binary units for messages (ckpt_tune.units owns the display format; this is for errors)."""
    for power in (4, 3, 2, 1):
        if abs(n) >= 2 ** (10 * power):
            return f"{n / 2 ** (10 * power):.1f} {_BINARY_NAMES[power]}"
    return f"{n} bytes"


def _read_bytes(text: str, what: str = "--vram", accepted: str = ACCEPTED_BUDGETS) -> tuple[int, str]:
    """(bytes, how they were read). Fractions are exact; a fractional byte count rounds down."""
    given = text.strip()
    hint = f"accepted forms: {accepted} (GB is read as GiB)"
    match = _BYTES_RE.match(given)
    if match is None:
        problem = "is negative" if given.startswith("-") else "is not a memory size"
        raise BudgetError(f"{what} {text!r} {problem}", hint=hint)
    num, unit = match["num"], match["unit"].lower()
    if unit not in _UNIT_POWERS:
        raise BudgetError(f"{what} {text!r} has an unknown unit {match['unit']!r}", hint=hint)
    power = _UNIT_POWERS[unit]
    if power == 0 and "." in num:
        raise BudgetError(f"{what} {text!r} is a fractional number of bytes", hint=hint)
    exact = Fraction(num) * 2 ** (10 * power)
    value = math.floor(exact)
    if value <= 0:
        problem = "is zero" if exact == 0 else "rounds down to zero bytes"
        raise BudgetError(f"{what} {text!r} {problem}", hint=hint)
    if power == 0:
        how = f"{value} bytes"
    else:
        binary = f"{num} {_BINARY_NAMES[power]}"
        how = (
            f"{given} = {value} bytes"
            if "i" in unit
            else f"{given} read as {binary} (binary units) = {value} bytes"
        )
        if exact != value:
            how += f" (rounded down from {float(exact)})"
    return value, how


def parse_bytes(text: str, what: str = "--vram", accepted: str = ACCEPTED_BUDGETS) -> int:
    """`24GB` -> 24 * 2**30. GB/MB/KB/TB (and G/M/K/T) are read as their binary units.

    `what` names the value in an error (a BudgetError), `accepted` lists the forms in its hint."""
    return _read_bytes(text, what, accepted)[0]


def _parse_percent(text: str) -> Fraction:
    """`5%` -> 1/20. A private stand-in until ckpt_tune.units.parse_percent is in place."""
    given = text.strip()
    if not re.fullmatch(r"(\d+(\.\d*)?|\.\d+)\s*%", given):
        raise BudgetError(f"--margin {text!r} is not a number followed by %", hint=ACCEPTED_MARGINS)
    return Fraction(given.rstrip("%").strip()) / 100


def _margin_bytes(margin: str | float | None, total: int, kind: str) -> tuple[int, str]:
    """(bytes, how they were read). A share of the total rounds up: a margin errs on the safe side."""
    if margin is None:
        share = DEFAULT_CUDA_MARGIN if kind == "cuda" else Fraction(0)
        how = f"default {float(share) * 100:g}% on {kind}"
    elif isinstance(margin, (int, float)) and not isinstance(margin, bool) and math.isfinite(margin):
        share, how = Fraction(margin), f"{margin:g} of the total"
    elif isinstance(margin, str) and margin.strip().endswith("%"):
        share, how = _parse_percent(margin), f"{margin.strip()} of the total"
    elif isinstance(margin, str) and re.fullmatch(r"\s*(\d+(\.\d*)?|\.\d+)\s*", margin):
        share, how = Fraction(margin.strip()), f"{margin.strip()} of the total"
    elif isinstance(margin, str):
        value, read = _read_bytes(margin, "--margin", ACCEPTED_MARGINS)
        return value, f"--margin {read}"
    else:
        raise BudgetError(f"--margin {margin!r} is not a percentage, fraction or size", hint=ACCEPTED_MARGINS)
    if not 0 <= share < 1:
        raise BudgetError(
            f"--margin {margin!r} is not a share of the budget between 0 and 1",
            hint=f"accepted forms: {ACCEPTED_MARGINS}; a size in bytes needs a unit (512MiB)",
        )
    return math.ceil(total * share), how


def parse_budget(text: str, device: str | None = "cpu", margin: str | float | None = None) -> Budget:
    """Read `--vram` (and `--margin`) for a plan that will run on `device`.

    usable = total - CUDA context - margin; context and the default margin apply on cuda only.
    """
    if device is None or device.strip().lower() == "auto":
        device = resolve_device(device)
    kind, index = _split_device(device)
    if text.strip().lower() == "auto":
        found = gpu_total_memory(index)
        if found is None:
            raise BudgetError(
                "--vram auto found no GPU on this machine (NVML and torch.cuda both saw none)",
                hint="pass --vram explicitly, e.g. --vram 24GB",
            )
        total, name, where = found
        how = f"auto: {name} total {_format_bytes(total)} ({where})"
    else:
        total, how = _read_bytes(text)
    context, context_how = cuda_context(index) if kind == "cuda" else (0, "")
    margin_bytes, margin_how = _margin_bytes(margin, total, kind)
    usable = total - context - margin_bytes
    if kind == "cuda":
        how += f"; held back {_format_bytes(context)} for the CUDA context ({context_how})"
    if margin_bytes:
        how += f"; margin {_format_bytes(margin_bytes)} ({margin_how})"
    if usable <= 0:
        raise BudgetError(
            f"--vram {text.strip()!r} ({total} bytes) leaves nothing usable after {_format_bytes(context)} "
            f"of CUDA context and a {_format_bytes(margin_bytes)} margin",
            hint="raise --vram, or lower --margin",
        )
    return Budget(total, context + margin_bytes, margin_bytes, context, usable, how)


def _split_device(device: str) -> tuple[str, int]:
    """`cuda:1` -> ("cuda", 1); `cpu` -> ("cpu", 0). Raises DeviceError on anything else."""
    text = device.strip().lower()
    match = re.fullmatch(r"(cpu|meta|cuda)(?::(\d+))?", text)
    if match is None or (match[2] is not None and match[1] != "cuda"):
        raise DeviceError(f"device {device!r} is not one of {ACCEPTED_DEVICES}", hint="e.g. --device cuda:0")
    return match[1], int(match[2] or 0)


def resolve_device(requested: str | None) -> str:
    """None/"auto" -> "cuda" when torch sees a GPU, else "cpu". A named CUDA device must exist."""
    if requested is None or requested.strip().lower() == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, index = _split_device(requested)
    if kind != "cuda":
        return kind
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {requested!r} asked for, but torch {torch.__version__} sees no CUDA device",
            hint="use --device cpu or --device meta",
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(
            f"device {requested!r} asked for, but torch sees {count} CUDA device(s) (cuda:0..cuda:{count - 1})",
            hint="use --device cuda:0, or check CUDA_VISIBLE_DEVICES",
        )
    return requested.strip().lower()


def device_info(kind: str) -> DeviceInfo:
    """What `kind` (cpu, meta, cuda, cuda:N) is; for a GPU, its name and memory."""
    name, index = _split_device(kind)
    if name != "cuda":
        return DeviceInfo(name, name, None, "n/a")
    found = gpu_total_memory(index)
    if found is None:
        raise DeviceError(
            f"device {kind!r}: no GPU found (NVML and torch.cuda saw none)", hint="use --device cpu"
        )
    total, gpu_name, where = found
    return DeviceInfo("cuda", gpu_name, total, where)


def _nvml_handle(pynvml, index: int):
    """NVML's handle for torch's cuda:`index`. CUDA and NVML may number GPUs differently
    (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER), so match by UUID when torch can read it."""
    if torch.cuda.is_available():
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries):
        raise LookupError(f"CUDA_VISIBLE_DEVICES={visible!r} has no entry {index}")
    entry = entries[index]
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    if entry.startswith("GPU-"):
        return pynvml.nvmlDeviceGetHandleByUUID(entry)
    raise LookupError(f"CUDA_VISIBLE_DEVICES entry {entry!r} cannot be matched to an NVML device")


def _nvml_total(index: int) -> tuple[int, str, str]:
    """(bytes CUDA can allocate, name, source) from NVML. Raises on any failure."""
    import pynvml  # optional dependency (nvidia-ml-py): only needed on GPU machines

    pynvml.nvmlInit()
    try:
        handle = _nvml_handle(pynvml, index)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        try:
            mig_on = pynvml.nvmlDeviceGetMigMode(handle)[0] == 1
        except pynvml.NVMLError:  # not a MIG-capable GPU
            mig_on = False
        if mig_on:
            raise LookupError("MIG is on: NVML's total is the whole GPU, not this slice")
        try:
            # v2 separates what the driver and firmware reserve; CUDA cannot allocate that part,
            # and cudaMemGetInfo's total leaves it out too.
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            return int(mem.total - mem.reserved), name, "NVML"
        except (pynvml.NVMLError, AttributeError):  # driver or binding without the v2 call
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), name, "NVML (v1 total)"
    finally:
        pynvml.nvmlShutdown()


def gpu_total_memory(device_index: int = 0) -> tuple[int, str, str] | None:
    """(bytes, GPU name, source) for cuda:`device_index`: NVML, else torch.cuda.mem_get_info.

    None when neither sees a GPU. A fallback's source says why NVML was not used.
    """
    try:
        return _nvml_total(device_index)
    except ImportError:
        nvml_failed = "pynvml not importable; install nvidia-ml-py"
    except Exception as exc:  # NVMLError_*, LookupError, a driver without NVML: ask torch instead
        nvml_failed = f"{type(exc).__name__}: {exc}".rstrip(": ")
    if not torch.cuda.is_available() or device_index >= torch.cuda.device_count():
        return None
    _free, total = torch.cuda.mem_get_info(device_index)
    name = torch.cuda.get_device_name(device_index)
    return int(total), name, f"torch.cuda.mem_get_info (NVML not used: {nvml_failed})"


def cuda_context(device_index: int = 0) -> tuple[int, str]:
    """(bytes, how known) of CUDA context and other memory outside PyTorch's caching allocator.

    Measured as NVML's used memory for this process minus torch.cuda.memory_reserved(); possible
    only once this process has initialized CUDA and NVML can see its PID. Else the default estimate.
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return DEFAULT_CUDA_CONTEXT_BYTES, "default estimate: CUDA not initialized in this process"
    try:
        import pynvml  # optional dependency, see _nvml_total

        pynvml.nvmlInit()
        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(_nvml_handle(pynvml, device_index))
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # no NVML, no driver, unmatched device: fall back to the estimate
        return DEFAULT_CUDA_CONTEXT_BYTES, f"default estimate: NVML unavailable ({type(exc).__name__})"
    used = next((p.usedGpuMemory for p in procs if p.pid == os.getpid()), None)
    if used is None:  # not listed (PID namespace) or usedGpuMemory not reported
        return DEFAULT_CUDA_CONTEXT_BYTES, "default estimate: NVML does not report this process"
    context = int(used) - torch.cuda.memory_reserved(device_index)
    if context <= 0:
        return DEFAULT_CUDA_CONTEXT_BYTES, "default estimate: NVML's per-process figure is below reserved"
    return context, "measured: NVML process memory minus torch.cuda.memory_reserved()"


def cuda_context_bytes(device_index: int = 0) -> int:
    """Bytes of CUDA context on cuda:`device_index`, measured where possible (see cuda_context)."""
    return cuda_context(device_index)[0]
