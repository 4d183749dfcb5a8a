"""What a search says when nothing fits, or when its own machinery fails (docs/design.md §4, §10)."""

from __future__ import annotations

from ckpt_tune.errors import LimitationError, NoFitError
from ckpt_tune.tune.planner import min_peak
from ckpt_tune.tune.search_state import SearchState, first_line
from ckpt_tune.tune.sharding import static_per_gpu
from ckpt_tune.units import format_bytes


class Verdicts(SearchState):
    """The errors a search raises: no fit (`_no_fit`, `_states_over`), ckpt-tune's failure (`_limitation`)."""

    def states(self) -> tuple[int, int, int]:
        """(parameters, gradients, optimizer state) on one GPU, as of the last recorded step."""
        params, opt, grads = self.runner.state_bytes()
        if self.sharding == "arithmetic":
            per = static_per_gpu(params, grads, opt, self.world_size, self.shard, self.gathered_bytes())
            params, grads, opt = per.params + per.gathered, per.grads, per.optimizer
        return params, grads, opt

    def _states_over(self, budget: int, where: str = "") -> NoFitError | None:
        """The answer when weights + gradients + optimizer state alone exceed the budget (None if not):
        no plan or batch can help, so search says so after its first recorded step."""
        params, grads, opt = self.states()
        states = params + grads + opt
        if states <= budget:
            return None
        n = sum(p.numel() for p in self.runner.model.parameters() if p.requires_grad) or 1
        return NoFitError(
            f"nothing fits {format_bytes(budget)}: weights + gradients + optimizer state alone are "
            f"{format_bytes(states)} ({format_bytes(params)} + {format_bytes(grads)} + {format_bytes(opt)}, "
            f"{states / n:.1f} bytes per trainable parameter), more than the budget before any activation"
            + (f"; {where}" if where else ""),
            "no checkpoint plan can fix that: shard the states over GPUs (FSDP / ZeRO-3), use an 8-bit optimizer "
            "or train adapters (LoRA); `ckpt-tune diagnose` predicts each",
        )

    def _no_fit(self, budget: int, b: int, verified: dict[tuple[int, ...], int] | None = None) -> NoFitError:
        t = self.terms(b)
        mp = min_peak(t, self.costs(b))
        over = [p for p in (verified or {}).values() if p > budget]
        if mp.peak <= budget and over:
            # the model says a plan fits, but every plan run measured over the budget
            return NoFitError(
                f"no verified plan fits {format_bytes(budget)} at batch {b}: {len(over)} plan(s) predicted to fit "
                f"measured over it when recorded (by up to {format_bytes(max(over) - budget)}), though the smallest "
                f"predicted peak is {format_bytes(mp.peak)}",
                "the memory model is optimistic for this model here; allow that much more --vram or a smaller "
                "--batch-size, and please report it (ckpt-tune search --json shows the plans tried)",
            )
        where = (
            f"the smallest peak reachable at batch {b} is {format_bytes(mp.peak)} "
            f"(checkpointing in {sum(1 for c in mp.choice if c)} of {len(self.units)} blocks)"
        )
        alone = self._states_over(budget, where)
        if alone is not None:
            return alone
        states = sum(self.states())
        return NoFitError(
            f"nothing fits {format_bytes(budget)}: {where}; weights + gradients + optimizer state are "
            f"{format_bytes(states)}, the step's activations and temporaries the rest",
            "raise --vram, use --precision bf16-mixed, a smaller --batch-size, or see `ckpt-tune diagnose`",
        )

    def _limitation(self, error: BaseException) -> LimitationError:
        return LimitationError(
            f"ckpt-tune could not plan this model: the training step runs as it is, but ckpt-tune's own "
            f"machinery failed on it ({first_line(error)}); chain of {len(self.units)} candidate modules"
            + (f", first {self.units[0]}" if self.units else ""),
            "this is a limitation of ckpt-tune, not an error in your step: please report it with the output "
            "of --debug; `--candidates blocks` offers fewer refinements",
        )

