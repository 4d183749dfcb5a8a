"""Target string → `Target`: the model's build function, its batches and its loss.

`path/to/file.py:fn` or `package.module:fn` becomes a `Target` that records where each part came
from, so every later message can name the user's own file. An import that fails or a name that is not
there becomes a `TargetError` with one line and a hint, never a raw traceback; the original exception is
chained (`raise ... from`) so `--debug` can still show it. Calling the user's functions is user_code.py.

`torch.OutOfMemoryError` is never wrapped: running out of memory is what the profiler and `check`
measure, not a mistake in the user's code.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ckpt_tune.errors import TargetError

ACCEPTED_FORMS = "path/to/file.py:fn or package.module:fn"
DEFAULT_LOSS_RULE = "default rule (output.loss / scalar / sum of floating outputs)"
DEBUG_HINT = "call the function directly to debug it, or rerun with --debug for the full traceback"
# torch.OutOfMemoryError is new in torch 2.5; the CUDA name is an alias of it there and exists before.
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
# Failures of this machine, not of the user's code: the device running out of memory, the host allocator
# refusing a request, and oneDNN having no CPU kernel for an op at this precision (bf16 LSTM without
# AVX-512, for one). They pass through the user-code wrappers here; session.user_errors says what they are.
HOST_OOM = "DefaultCPUAllocator: can't allocate memory"
MISSING_KERNEL = "could not create a primitive descriptor"


def not_the_users(exc: BaseException) -> bool:
    """True for a failure of the machine, which the user-code wrappers let through."""
    return isinstance(exc, _OOM) or (
        isinstance(exc, RuntimeError) and (HOST_OOM in str(exc) or MISSING_KERNEL in str(exc))
    )



@dataclass(frozen=True)
class Target:
    spec: str  # the string the user gave, e.g. "examples/gpt.py:build"
    module_name: str  # imported module's name
    file_path: Path | None  # resolved file, None for package.module targets
    fn_name: str
    build_fn: Callable[[], Any]
    batch_fn: Callable[[int], Any]
    loss_fn: Callable[[Any, Any], Any] | None
    batch_source: str  # where make_batch came from, for messages
    loss_source: str  # where loss_fn came from, or DEFAULT_LOSS_RULE
    is_hf: bool = False  # built from a Hugging Face config (hf.py)


# --- resolving target strings ------------------------------------------------------------------


def _split(spec: str, what: str) -> tuple[str, str]:
    # rpartition keeps Windows drive letters ("C:\\m.py:build") in the left part.
    left, colon, fn_name = spec.strip().rpartition(":")
    if not colon or not left or not fn_name:
        raise TargetError(
            f"bad {what} {spec!r}: expected {ACCEPTED_FORMS}",
            hint="e.g. examples/gpt.py:build or mypkg.models:build",
        )
    if not fn_name.isidentifier():
        raise TargetError(
            f"bad {what} {spec!r}: {fn_name!r} is not a function name", hint=f"use {ACCEPTED_FORMS}"
        )
    return left, fn_name


def _is_file_form(left: str) -> bool:
    return left.endswith(".py") or "/" in left or os.sep in left


def type_name(obj: Any) -> str:
    """The qualified name of obj's type, for messages (`int`, `torch.Tensor`)."""
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def error_location(exc: BaseException, roots: set[Path]) -> str:
    """' (at file:line)' for the innermost frame in the user's code, or ''."""
    frames = [(f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__)]
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        frames.append((exc.filename, exc.lineno))
    for filename, lineno in reversed(frames):
        path = Path(filename).resolve()
        in_packages = "site-packages" in path.parts or "dist-packages" in path.parts
        if not in_packages and any(path.is_relative_to(root) for root in roots):
            return f" (at {_display(path)}:{lineno})"
    return ""


@contextlib.contextmanager
def _on_sys_path(directory: Path) -> Iterator[None]:
    # Sibling imports (`from layers import Block`) need the file's directory on sys.path while the
    # module runs; leaving it there would let one target's files shadow another's.
    entry = str(directory)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        if entry in sys.path:
            sys.path.remove(entry)


def _import_file(left: str, cache: dict[str, ModuleType]) -> ModuleType:
    path = Path(left).expanduser()
    path = (path if path.is_absolute() else Path.cwd() / path).resolve()
    if str(path) in cache:
        return cache[str(path)]
    if not path.is_file():
        hint = f"paths are relative to the current directory ({Path.cwd()})"
        if path.with_suffix(".py").is_file():
            hint = f"did you mean {left}.py?"
        raise TargetError(f"file not found: {path}", hint=hint)
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    name = f"_ckpt_tune_target_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TargetError(f"cannot import {path}: not a Python source file", hint=f"use {ACCEPTED_FORMS}")
    module = importlib.util.module_from_spec(spec)
    # Registered before running so dataclasses and pickling can find the module by name.
    sys.modules[name] = module
    try:
        with _on_sys_path(path.parent):
            spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[name]
        raise _import_error(left, exc, {path.parent}) from exc
    cache[str(path)] = module
    return module


def _import_error(left: str, exc: BaseException, roots: set[Path]) -> TargetError:
    hint = f"fix the error in {left}, or rerun with --debug for the full traceback"
    if isinstance(exc, ModuleNotFoundError):
        hint = f"install the missing module {exc.name!r} in this environment, or fix the import"
    elif isinstance(exc, SystemExit):
        hint = "the module exits when imported: put the script's body under `if __name__ == '__main__':`"
    return TargetError(f"importing {left} raised {first_line(exc)}{error_location(exc, roots)}", hint=hint)


def _import_module(left: str, what: str) -> ModuleType:
    if not all(part.isidentifier() for part in left.split(".")):
        raise TargetError(
            f"bad {what} {left!r}: not a file path or a module name", hint=f"use {ACCEPTED_FORMS}"
        )
    # `python -m` puts the current directory first on sys.path; do the same for `pkg.mod` targets.
    try:
        with _on_sys_path(Path.cwd()):
            return importlib.import_module(left)
    except ModuleNotFoundError as exc:
        if exc.name and (left == exc.name or left.startswith(exc.name + ".")):
            raise TargetError(
                f"module {left!r} not importable: {first_line(exc)}",
                hint=f"run from the directory that contains it, install it, or give a file path ({ACCEPTED_FORMS})",
            ) from exc
        raise _import_error(left, exc, _module_roots(left)) from exc
    except (Exception, SystemExit) as exc:
        raise _import_error(left, exc, _module_roots(left)) from exc


def _module_roots(left: str) -> set[Path]:
    try:
        with _on_sys_path(Path.cwd()):
            spec = importlib.util.find_spec(left.split(".")[0])
    except (ImportError, ValueError):
        return set()
    origin = spec.origin if spec else None
    return {Path(origin).resolve().parent} if origin else set()


def _defined_callables(module: ModuleType) -> list[str]:
    """Public callables defined in the module or its submodules (a package re-exports those), not imports."""
    own = module.__name__

    def is_own(obj: Any) -> bool:
        where = getattr(obj, "__module__", None) or ""
        return where == own or where.startswith(own + ".")

    return sorted(
        n for n, obj in vars(module).items() if callable(obj) and not n.startswith("_") and is_own(obj)
    )


def _lookup(module: ModuleType, left: str, fn_name: str, what: str) -> Callable[..., Any]:
    if not hasattr(module, fn_name):
        defined = _defined_callables(module)
        listing = (
            ", ".join(defined[:10]) + (", …" if len(defined) > 10 else "") if defined else "nothing callable"
        )
        close = difflib.get_close_matches(fn_name, defined, n=1)
        hint = f"did you mean {left}:{close[0]}?" if close else f"define {fn_name}() in {left}"
        raise TargetError(f"no function {fn_name!r} in {left} ({what}); it defines: {listing}", hint=hint)
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise TargetError(
            f"{left}:{fn_name} ({what}) is not a function: its type is {type_name(fn)}",
            hint=f"point {what} at a function, e.g. def {fn_name}(...): ...",
        )
    return fn


def _resolve(spec: str, what: str, cache: dict[str, ModuleType], home: ModuleType, home_left: str):
    """Resolve an override; a bare name (`--batch-fn my_batch`) is looked up in the target's module."""
    if ":" not in spec and spec.strip().isidentifier():
        return _lookup(home, home_left, spec.strip(), what), f"{home_left}:{spec.strip()}"
    left, fn_name = _split(spec, what)
    module = _import_file(left, cache) if _is_file_form(left) else _import_module(left, what)
    return _lookup(module, left, fn_name, what), spec.strip()


def load_target(spec: str, batch_fn: str | None = None, loss_fn: str | None = None) -> Target:
    """Import the target's module and find `fn`, `make_batch` and (optionally) `loss_fn`."""
    left, fn_name = _split(spec, "target")
    cache: dict[str, ModuleType] = {}
    file_form = _is_file_form(left)
    module = _import_file(left, cache) if file_form else _import_module(left, "target")
    build = _lookup(module, left, fn_name, "target")

    if batch_fn is not None:
        batch, batch_source = _resolve(batch_fn, "--batch-fn", cache, module, left)
    elif hasattr(module, "make_batch"):
        batch, batch_source = _lookup(module, left, "make_batch", "make_batch"), f"{left}:make_batch"
    else:
        raise TargetError(
            f"no make_batch(batch_size) in {left}: looked for it next to {fn_name}",
            hint=f"define make_batch(batch_size) in {left}, or point to one with --batch-fn path/to/file.py:fn",
        )

    loss: Callable[[Any, Any], Any] | None = None
    loss_source = DEFAULT_LOSS_RULE
    if loss_fn is not None:
        loss, loss_source = _resolve(loss_fn, "--loss-fn", cache, module, left)
    elif hasattr(module, "loss_fn"):
        loss, loss_source = _lookup(module, left, "loss_fn", "loss_fn"), f"{left}:loss_fn"

    return Target(
        spec=spec.strip(),
        module_name=module.__name__,
        file_path=Path(module.__file__).resolve() if file_form and module.__file__ else None,
        fn_name=fn_name,
        build_fn=build,
        batch_fn=batch,
        loss_fn=loss,
        batch_source=batch_source,
        loss_source=loss_source,
    )
