"""Read PyTorch's out-of-memory message and tell a real shortage from fragmentation.

The CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, `malloc`) raises, since PyTorch 2.1:

    CUDA out of memory. Tried to allocate R. GPU g has a total capacity of T of which F is free.
    [Process p has X memory in use. | Including non-PyTorch memory, this process has X memory in use.]
    [A allowed; ]Of the allocated memory A is allocated by PyTorch, [with P allocated in private pools
    (e.g., CUDA Graphs), ]and U is reserved by PyTorch but unallocated. ...

and before 2.1: `Tried to allocate R (GPU g; T total capacity; A already allocated; F free; [X allowed; ]
S reserved in total by PyTorch)`. Sizes are printed with two decimals in bytes/KiB/MiB/GiB.

The message is built after the allocator has already returned every unsplit cached block to the driver,
so U (reserved but unallocated) is what is left in split blocks: free memory cut into pieces. Hence:

- F + U ≥ R: the bytes exist, not in one piece: fragmentation. `expandable_segments:True` lets the
  allocator map such pieces into one growing segment.
- F + U < R: a real shortage of R − F − U bytes (at least); U counts as waste on top when it is large.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from ckpt_tune.errors import CkptTuneError
from ckpt_tune.units import format_bytes

_SIZE = r"(\d+(?:\.\d+)?) ?(bytes|B|KiB|MiB|GiB|TiB)"  # number, unit
_UNITS = {"bytes": 0, "B": 0, "KiB": 1, "MiB": 2, "GiB": 3, "TiB": 4}


def _sz(name: str) -> str:
    return rf"(?P<{name}>\d+(?:\.\d+)?) ?(?P<{name}_u>bytes|B|KiB|MiB|GiB|TiB)"


_NEW = re.compile(
    rf"(?P<kind>CUDA|HIP|XPU) out of memory\. Tried to allocate {_sz('r')}\. GPU (?P<gpu>\d+) has a total "
    rf"(?:capacity|capacty) of {_sz('t')} of which {_sz('f')} is free\."
)
_LEGACY = re.compile(
    rf"(?P<kind>CUDA|HIP) out of memory\. Tried to allocate {_sz('r')} \(GPU (?P<gpu>\d+); {_sz('t')} total "
    rf"capacity; {_sz('a')} already allocated; {_sz('f')} free; (?:{_sz('allowed')} allowed; )?{_sz('s')} "
    r"(?:reserved in total by PyTorch|cached)\)"
)
_ALLOCATED = re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch")
_PRIVATE = re.compile(r"with " + _SIZE + r" allocated in private pools")
_UNALLOCATED = re.compile(_SIZE + r" is reserved by PyTorch but unallocated")
_PROCESS = re.compile(r"Process (\d+) has " + _SIZE + r" memory in use")
_THIS = re.compile(r"this process has " + _SIZE + r" memory in use")
_ALLOWED = re.compile(_SIZE + r" allowed;")


def parse_size(number: str, unit: str) -> int:
    """`("1.50", "GiB")` -> bytes. PyTorch prints two decimals, so a GiB value is good to ±5 MiB."""
    return round(float(number) * 1024 ** _UNITS[unit])


def _get(m: re.Match[str], name: str) -> int:
    return parse_size(m[name], m[name + "_u"])


@dataclass(frozen=True)
class OomMessage:
    """The numbers of one out-of-memory message. None where this form of the message does not say."""

    kind: str  # CUDA, HIP, XPU
    gpu: int
    requested: int  # the one allocation that failed
    total: int  # the GPU's capacity
    free: int  # free on the GPU (driver) when it failed
    allocated: int | None  # live tensors of this process, by PyTorch's allocator
    reserved_unallocated: int | None  # held by the allocator, not in a tensor: pieces of split blocks
    private_pools: int  # CUDA Graphs' private pools
    this_process: int | None  # "including non-PyTorch memory": context, cuBLAS/NCCL workspaces, other allocators
    processes: tuple[tuple[int, int], ...]  # (pid, bytes) of processes NVML lists on the GPU
    allowed: int | None  # set_per_process_memory_fraction's cap
    form: str  # "2.1+" or "legacy"
    text: str  # the message as found


def parse_oom(text: str) -> OomMessage:
    """The first out-of-memory message in `text` (a log, a traceback, or the message alone)."""
    flat = " ".join(text.split())  # logs wrap long lines
    m = _NEW.search(flat)
    if m is not None:
        tail = flat[m.start():]
        end = tail.find("out of memory", 20)  # a second message in the same log starts there
        tail = tail if end < 0 else tail[:end]
        allocated = _first(_ALLOCATED, tail)
        unalloc = _first(_UNALLOCATED, tail)
        return OomMessage(
            kind=m["kind"], gpu=int(m["gpu"]),
            requested=_get(m, "r"), total=_get(m, "t"), free=_get(m, "f"),
            allocated=allocated, reserved_unallocated=unalloc, private_pools=_first(_PRIVATE, tail) or 0,
            this_process=_first(_THIS, tail),
            processes=tuple((int(p[0]), parse_size(p[1], p[2])) for p in _PROCESS.findall(tail)),
            allowed=_first(_ALLOWED, tail), form="2.1+", text=_message_text(tail),
        )
    m = _LEGACY.search(flat)
    if m is not None:
        allocated, reserved = _get(m, "a"), _get(m, "s")
        return OomMessage(
            kind=m["kind"], gpu=int(m["gpu"]),
            requested=_get(m, "r"), total=_get(m, "t"), free=_get(m, "f"),
            allocated=allocated, reserved_unallocated=max(reserved - allocated, 0), private_pools=0,
            this_process=None, processes=(),
            allowed=_get(m, "allowed") if m["allowed"] else None, form="legacy",
            text=flat[m.start():m.end()],
        )
    raise CkptTuneError(
        "no PyTorch out-of-memory message found (looked for 'CUDA out of memory. Tried to allocate …')",
        "pass the file holding the traceback, or - to read it from stdin",
    )


def _first(rx: re.Pattern[str], text: str) -> int | None:
    m = rx.search(text)
    return parse_size(m[1], m[2]) if m else None


def _message_text(tail: str) -> str:
    cut = tail.find(" If reserved but unallocated")
    return (tail if cut < 0 else tail[:cut]).strip()


@dataclass(frozen=True)
class OomDiagnosis:
    message: OomMessage
    cause: str  # fragmentation | shortage | request-exceeds-gpu | capped | unexplained
    summary: str  # one line
    details: tuple[str, ...]
    recommendations: tuple[str, ...]
    shortfall_bytes: int  # bytes missing even if every piece were joined (0 for fragmentation)
    fragmented_bytes: int  # reserved but unallocated

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
# Reserved-but-unallocated bytes worth a word even when the request is short anyway.
LARGE_WASTE_SHARE = 0.05  # of the GPU's capacity


def classify(msg: OomMessage) -> OomDiagnosis:
    r, t, f = msg.requested, msg.total, msg.free
    u = msg.reserved_unallocated or 0
    a = msg.allocated
    fmt = format_bytes
    details = [f"requested {fmt(r)}; GPU {msg.gpu} total {fmt(t)}, free {fmt(f)}"]
    if a is not None:
        details.append(f"PyTorch: {fmt(a)} in tensors, {fmt(u)} reserved but unallocated (split cached blocks)")
    if msg.this_process is not None and a is not None:
        outside = msg.this_process - a - u - msg.private_pools
        if outside > 0:
            details.append(f"this process holds {fmt(outside)} outside PyTorch's allocator (CUDA context, library workspaces)")
    if msg.processes:
        details.append("processes on the GPU: " + ", ".join(f"pid {p} {fmt(b)}" for p, b in msg.processes))
    recs: list[str] = []
    shortfall = max(r - f - u, 0)
    pieces_hold = u >= r
    reserved = (a or 0) + u + msg.private_pools
    if r > t:
        cause = "request-exceeds-gpu"
        summary = f"one allocation of {fmt(r)} is larger than the whole GPU ({fmt(t)}): no allocator setting helps"
        recs.append("look for a shape that grew by mistake (an N×N attention or distance matrix, a wrong reshape), or shrink that tensor's batch/sequence")
    elif pieces_hold or (f < r <= f + u):
        cause = "fragmentation"
        pieces = "the allocator's cached pieces alone" if pieces_hold else "free memory and the allocator's cached pieces together"
        summary = (
            f"{fmt(u)} is reserved but unallocated and {fmt(f)} free, yet the {fmt(r)} request "
            f"found no contiguous block; {pieces} would hold it"
        )
        recs.append(f"set {EXPANDABLE} before the process starts (the allocator then grows one segment and reuses split pieces)")
        recs.append("if it is set already, keep tensor sizes steady between steps (pad variable-length batches to a few fixed sizes)")
    elif msg.allowed is not None and reserved + r > msg.allowed:
        cause = "capped"
        summary = (
            f"the process is capped at {fmt(msg.allowed)} (set_per_process_memory_fraction): {fmt(reserved)} reserved "
            f"+ {fmt(r)} requested is over the cap"
        )
        recs.append(f"raise the memory fraction, or cut the step's peak: ckpt-tune diagnose TARGET --vram {_vram(msg.allowed)}")
    elif f >= r:
        cause = "unexplained"
        summary = f"{fmt(f)} was free for a {fmt(r)} request: another process or a driver-level limit took it first"
        recs.append("check other processes on the GPU (nvidia-smi) and the container's memory limits")
    else:
        cause = "shortage"
        summary = f"{fmt(shortfall)} more is needed even if every free piece were joined"
        if u >= LARGE_WASTE_SHARE * t:
            summary += f"; fragmentation wastes another {fmt(u)}"
            recs.append(f"{EXPANDABLE} recovers the {fmt(u)} of cached pieces, but the step still needs {fmt(shortfall)} less")
        recs.append(f"cut the step's peak by at least {fmt(shortfall)}: ckpt-tune diagnose TARGET --vram {_vram(t)} ranks the remedies")
    if msg.processes and len(msg.processes) > 1:
        recs.append(f"{len(msg.processes)} processes share the GPU ({fmt(sum(b for _, b in msg.processes))}): another one may hold what this one lacks")
    return OomDiagnosis(msg, cause, summary, tuple(details), tuple(recs), 0 if cause == "fragmentation" else shortfall, u)


def _vram(n: int) -> str:
    return f"{n / 2**30:.2f}GiB"


def diagnose_oom(text: str) -> OomDiagnosis:
    """parse_oom then classify."""
    return classify(parse_oom(text))
