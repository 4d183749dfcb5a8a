"""Calling the user's functions: `build_model`, `make_batch`, `call_model`, `compute_loss` (with
`default_loss` where the target has no loss_fn). Everything the user's code does wrong (`build` raises
or returns the wrong thing, the loss is not a trainable scalar) becomes a `UserCodeError` naming the
user's file and line, with a hint (docs/design.md §10); a failure of the machine (`loader.not_the_users`)
passes through.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckpt_tune.errors import CkptTuneError, UserCodeError
from ckpt_tune.measure.loader import (
    DEBUG_HINT,
    Target,
    error_location,
    first_line,
    not_the_users,
    type_name,
)


def _user_roots(target: Target) -> set[Path]:
    """Directories whose frames count as the user's code when an error names a file:line."""
    roots = {target.file_path.parent} if target.file_path else set()
    for fn in (target.build_fn, target.batch_fn, target.loss_fn):
        # Builtins, callable objects and None have no source file: TypeError.
        with contextlib.suppress(TypeError):
            roots.add(Path(inspect.getfile(fn)).resolve().parent)  # type: ignore[arg-type]
    return roots


def build_model(target: Target) -> nn.Module:
    """Call the target's `fn()` and check that it returned an `nn.Module`."""
    try:
        model = target.build_fn()
    except Exception as exc:
        if not_the_users(exc) or isinstance(exc, CkptTuneError):  # a machine's failure; ckpt-tune's own words
            raise
        raise UserCodeError(
            f"{target.spec} raised {first_line(exc)}{error_location(exc, _user_roots(target))}", hint=DEBUG_HINT
        ) from exc
    if not isinstance(model, nn.Module):
        hint = f"{target.fn_name}() must return the model, e.g. `return GPT(config)`"
        if isinstance(model, (tuple, list)) and any(isinstance(m, nn.Module) for m in model):
            hint = f"{target.fn_name}() returned a {type(model).__name__} holding a module: return only the model"
        raise UserCodeError(f"{target.spec} returned {type_name(model)}, not a torch.nn.Module", hint=hint)
    return model


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return any(_has_tensor(v) for v in obj)
    return False


def move_to(obj: Any, device: torch.device | str) -> Any:
    """Move every tensor in a nested tuple/list/dict to `device`, keeping container types."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        moved = {k: move_to(v, device) for k, v in obj.items()}
        try:
            return type(obj)(moved)
        except TypeError:  # a mapping type that cannot be built from a dict (e.g. defaultdict)
            return moved
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(move_to(v, device) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(move_to(v, device) for v in obj)
    return obj


def make_batch(target: Target, batch_size: int, device: torch.device | str = "cpu") -> Any:
    """Call the batch function with `batch_size` and move the batch to `device`."""
    try:
        batch = target.batch_fn(batch_size)
    except Exception as exc:
        if not_the_users(exc):
            raise
        raise UserCodeError(
            f"{target.batch_source}({batch_size}) raised {first_line(exc)}{error_location(exc, _user_roots(target))}",
            hint=f"make_batch is called with the batch size as its only argument; {DEBUG_HINT}",
        ) from exc
    if batch is None or not _has_tensor(batch):
        got = "None" if batch is None else f"a {type(batch).__name__} with no tensor in it"
        raise UserCodeError(
            f"{target.batch_source}({batch_size}) returned {got}",
            hint="return the batch: a tensor, a tuple/list of tensors, or a dict of tensors",
        )
    return move_to(batch, device)


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call the model the way docs/design.md §2 says: dict → **batch, tuple/list → *batch, else (batch)."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _floating_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, Mapping):  # includes Hugging Face ModelOutput (an OrderedDict)
        for v in obj.values():
            yield from _floating_tensors(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _floating_tensors(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _floating_tensors(getattr(obj, field.name))


def default_loss(output: Any) -> torch.Tensor:
    """output.loss / output["loss"] if set, else a scalar output itself, else Σ t.sum() over floating tensors."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is not None:
        return loss
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output
    total: torch.Tensor | None = None
    for t in _floating_tensors(output):
        total = t.sum() if total is None else total + t.sum()
    if total is None:
        raise UserCodeError(
            f"the model's output ({type(output).__name__}) has no .loss and no floating tensor to sum into a loss",
            hint="define loss_fn(model, batch) next to build, or pass --loss-fn path/to/file.py:fn",
        )
    return total


def compute_loss(target: Target, model: nn.Module, batch: Any) -> torch.Tensor:
    """The target's loss_fn if it has one, else call the model and apply `default_loss`."""
    roots = _user_roots(target)
    if target.loss_fn is not None:
        try:
            loss = target.loss_fn(model, batch)
        except Exception as exc:
            if not_the_users(exc):
                raise
            raise UserCodeError(
                f"{target.loss_source} raised {first_line(exc)}{error_location(exc, roots)}", hint=DEBUG_HINT
            ) from exc
    else:
        try:
            output = call_model(model, batch)
        except Exception as exc:
            if not_the_users(exc):
                raise
            raise UserCodeError(
                f"the model's forward raised {first_line(exc)}{error_location(exc, roots)}",
                hint="check that the batch matches forward(): a dict is passed as **batch, "
                "a tuple/list as *batch, a tensor as one argument",
            ) from exc
        loss = default_loss(output)
    _check_loss(loss, target.loss_source)
    return loss


def _check_loss(loss: Any, source: str) -> None:
    if not isinstance(loss, torch.Tensor):
        raise UserCodeError(
            f"the loss from {source} is not a torch.Tensor: its type is {type_name(loss)}",
            hint="return a scalar tensor computed from the model's output",
        )
    if loss.numel() != 1:
        raise UserCodeError(
            f"the loss from {source} has shape {tuple(loss.shape)}; it must be a scalar (one element)",
            hint="reduce it, e.g. loss.mean() or loss.sum()",
        )
    # Under no_grad nothing requires grad; that is the caller's choice, not the user's mistake.
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise UserCodeError(
            f"the loss from {source} does not require grad: "
            "the loss does not depend on any trainable parameter",
            hint="check that parameters have requires_grad=True and nothing is detached or run under no_grad",
        )
