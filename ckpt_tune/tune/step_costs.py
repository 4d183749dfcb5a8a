"""What each option of a block costs in time, and the plain step's time (docs/design.md §4).

A checkpointed module's recompute costs its forward once more: the costs are the modules' forward times
in a timed step (`runner.time_step`), or their FLOPs where there is no device to time (under fake
tensors; identical blocks counted on the shortened chain). An op policy costs the share of its block's
forward in the ops it recomputes. With probes under fake tensors, one real step is timed at a batch
that fits the budget and scaled linearly in the batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from ckpt_tune.measure.forked import cores_left, fork_ahead, resident_bytes, usable_workers
from ckpt_tune.measure.host import HostGuard
from ckpt_tune.measure.op_costs import policy_ratios, recompute_shares
from ckpt_tune.measure.timing import Timing
from ckpt_tune.plan.entry import POLICIES
from ckpt_tune.plan.kinds import MARK, Pricing, kind_of, policy_of
from ckpt_tune.tune.batch_search import largest
from ckpt_tune.tune.memory_model import predict
from ckpt_tune.tune.repeats import count_flops, extend_forward, shortened
from ckpt_tune.tune.search_state import REAL_ROOM, SearchState

# An op policy whose recompute costs more than this fraction of checkpointing the whole block in every
# block is left out: it keeps more bytes than the whole-block checkpoint for (within timing noise, or
# the roofline's error under fake tensors) no less time, and each policy offered costs a recorded step
# per probed batch.
WORTH_A_POLICY = 0.9
# A step timed beside the probes, at a batch guessed before they ended, is taken where its batch is at least
# this fraction of the batch the probes then choose: the part of a step that does not grow with the batch
# (the optimizer step, launches) is shared over a few fewer samples, and the times are scaled from it.
CLOSE_BATCH = 0.85


class StepCosts(SearchState):
    """Costs per block and option, and the step's time, per batch (cached in `_costs`)."""

    def useful_policies(self, batch_size: int) -> list[str]:
        """The op policies that keep something in some block (one forward, measure/op_costs.py): a
        policy that keeps nothing is checkpointing the whole block, at the price of a recorded step."""
        shares = self._recompute_shares(batch_size, POLICIES, repeats=1)
        useful = [p for p in POLICIES if any(shares[(u, p)] < 1.0 for u in self.units)]
        if len(useful) < len(POLICIES):
            self.notes.append(
                "op policies that keep no op of any block, left out: "
                + ", ".join(p for p in POLICIES if p not in useful)
            )
        if not useful:
            return []
        if self.real.fake:
            # no device to time: a policy's cost is the share of the block's forward in the ops it
            # recomputes, on a roofline (the shares above, which price it in `_time` too)
            dear = {p: min(shares[(u, p)] for u in self.units) for p in useful}
            where = f"on a roofline of its ops (counted at batch {batch_size})"
        else:
            # each kind of block timed alone under each policy, at the second small batch where its
            # step fits (the first otherwise): a policy torch refuses is left out before any step is
            # recorded with it
            at = self._policy_batch(batch_size)
            got = self._ratios_ahead(at, useful)
            if got is None:
                with self._small_steps(at):
                    got = policy_ratios(self.real, at, self.units, useful)
            self._ratios, refused = got
            for p, why in refused.items():
                self.notes.append(f"op policy {p} left out: torch refused it on this model ({why})")
            useful = [p for p in useful if p not in refused]
            dear = {p: min(self._ratios[(u, p)] for u in self.units) for p in useful}
            where = f"on this device (measured at batch {at})"
        # one that costs about as much as checkpointing the whole block (WORTH_A_POLICY) is left out
        for p, worst in dear.items():
            if worst > WORTH_A_POLICY:
                self.notes.append(f"op policy {p} left out: its recompute costs {worst:.2f}x checkpointing the whole block {where}")
        useful = [p for p in useful if dear[p] <= WORTH_A_POLICY]
        return [p for p in useful if MARK + p not in self._dropped]

    def _small_steps(self, batch_size: int) -> contextlib.AbstractContextManager:
        return self.real.small_steps(batch_size) if isinstance(self.real, HostGuard) else contextlib.nullcontext()

    def policies_ahead(self, batch_size: int) -> None:
        """With probes under fake tensors on a CPU that runs one torch thread: the op policies timed as
        `useful_policies` times them, every policy on the candidate blocks, in a forked process on a core
        of its own, while this one records the ordering step under fake tensors. A forked process runs
        one thread (measure/forked.py): its times are this process's only where this one runs one too.
        Taken where the ordering kept every candidate (`_ratios_ahead`)."""
        if (
            self.real is self.runner
            or self.real.device.type != "cpu"
            or torch.get_num_threads() != 1
            or not any(k.timed for k in self.kinds)
            or self._by_calls
            or not self.units
            or usable_workers(2, resident_bytes()) < 2
            or cores_left(1) < 1
            or self._early_repeat() is not None  # a forked process records probes beside the ordering step
        ):
            return
        at, units = self._policy_batch(batch_size), self.units

        def job():
            with self._small_steps(at):
                return at, units, policy_ratios(self.real, at, units, POLICIES)

        self._ahead = fork_ahead(job)

    def _ratios_ahead(self, at: int, useful: list[str]) -> tuple[dict, dict] | None:
        """The ratios timed ahead (`policies_ahead`) of these policies, where they were timed at this batch
        on these blocks; None otherwise (or where the forked process failed): they are timed here."""
        ahead, self._ahead = self._ahead, None
        got = ahead.result() if ahead is not None else None
        if got is None or got[0] != at or set(got[1]) != set(self.units):
            return None
        ratios, refused = got[2]
        return {k: v for k, v in ratios.items() if k[1] in useful}, {p: why for p, why in refused.items() if p in useful}

    def _policy_batch(self, batch_size: int) -> int:
        """The batch op policies are timed at: the second small batch, unless the plain step there is
        not shown to fit the budget, REAL_ROOM under it. Only the user's real step at the first has run
        on the device; the second's is put on the line through it from the states alone (parameters,
        buffers, optimizer state), a line above the real one (the gradients count as activations)."""
        at = max(batch_size, self.b2)
        if at == batch_size or not self.budget or not self.real_peaks or self.real is self.runner:
            return at
        static = sum(self.real.state_bytes()[:2])
        per_sample = max(self.real_peaks[0] - static, 0) / batch_size
        return at if static + per_sample * at <= self.budget * (1 - REAL_ROOM) else batch_size

    def _recompute_shares(self, batch_size: int, policies, repeats: int = 3) -> dict[tuple[str, str], float]:
        """op_costs.recompute_shares of the chain; under fake tensors, identical blocks' on the shortened
        chain (a share is a count of FLOPs and bytes, the same for each of them)."""
        rep = self.repeat if self.runner.fake else None
        if rep is None:
            return recompute_shares(self.runner, batch_size, self.units, policies, repeats)
        with shortened(self.runner.model, rep, forward_only=True):  # the last step's gradients stay
            short = recompute_shares(self.runner, batch_size, rep.short_units, policies, repeats)
        ref = rep.extended()
        return {(u, p): short[(ref.get(u, u), p)] for u in self.units for p in policies}

    def costs(self, batch_size: int) -> tuple[tuple[float, ...], ...]:
        """Recompute cost of each block's options: the checkpointed module's forward time (ms) at this batch."""
        return self._timing(batch_size)[0]

    def step_ms(self, batch_size: int) -> float:
        return self._timing(batch_size)[1]

    def _timing(self, batch_size: int) -> tuple[tuple[tuple[float, ...], ...], float]:
        if batch_size not in self._costs:
            with self._stage("timing"):
                self._costs[batch_size] = self._time(batch_size)
        return self._costs[batch_size]

    def _time(self, batch_size: int) -> tuple[tuple[tuple[float, ...], ...], float]:
        scale, oom, t = 1.0, False, None
        if self.repeat is not None and self.real.fake:
            # FLOPs of identical blocks are identical: count them on the shortened chain
            self._say(f"counting FLOPs at batch {batch_size} on {len(self.repeat.short_units)} of {len(self.units)} blocks")
            rep = self.repeat
            with shortened(self.runner.model, rep):
                forward, step = count_flops(self.runner, batch_size)
            mid = step.get(rep.short_units[rep.first + 1], 0.0)
            total = step[None] + rep.removed * mid
            t = Timing(batch_size, (), max(total, 1e-9), extend_forward(forward, rep), unit="GFLOP")
        if t is None and self.real is not self.runner:
            t, scale = self._time_within_budget(batch_size)
        if t is None:
            try:
                t = self.runner.time_step(batch_size, repeats=3)
            except torch.OutOfMemoryError:
                oom = True  # the plain step at this batch exceeds the device (a real GPU): time a small one
        if oom:
            torch.cuda.empty_cache()
            self.notes.append(f"batch {batch_size}: the plain step does not fit the device; times scaled from batch {self.b2}")
            t, scale = self.runner.time_step(self.b2, repeats=3), batch_size / self.b2

        policies = [p for o in self.options if (p := policy_of(o)) is not None]
        at = batch_size if scale == 1.0 else self.b2
        # a policy's cost relative to its block's forward: on a device, its time against checkpointing
        # the whole block (measured once by order_units); under fake tensors, the share of the forward
        # in the ops it recomputes, on a roofline
        shares = self._recompute_shares(at, policies) if self.real.fake else self._ratios

        # each option's kind prices it (plan/kinds/): a recompute, less what a policy keeps; transfers
        pricing = Pricing(t.forward_ms, scale, t.unit, batch_size, shares, self.saved_per_unit, self.host_link)
        costs = tuple(
            (0.0, *(kind_of(self.options, k).cost(pricing, u, self.options[k]) for k in range(1, len(self.options))))
            for u in self.units
        )
        return costs, scale * t.step_ms

    def _timing_guess(self) -> int | None:
        """The batch `_time_within_budget` times at, guessed from the user's real step before the second
        small batch is probed, so that the timing runs beside its probes: the largest batch whose plain
        step the line from the states through that step puts REAL_ROOM under the budget (the gradients
        counted with the activations: above the fitted line, so a guess no larger, and a step within the
        budget). The timing is taken where the fitted terms then choose a batch at most 1/CLOSE_BATCH
        times as large. None: no real step to draw the line from."""
        if self._real_timing is not None or self._timed_beside is not None or self.real is self.runner:
            return None
        if not self.budget or not self.real_peaks:
            return None
        static = sum(self.real.state_bytes()[:2])
        per_sample = max(self.real_peaks[0] - static, 1) / self.b1
        at = int((self.budget * (1 - REAL_ROOM) - static) // per_sample)
        return at if at >= self.b1 else None

    def _time_beside(self, batch_size: int) -> None:
        """The real timing at the guessed batch, run beside the probes (`_full_terms`); one that fails
        is dropped: the timing runs again where the costs ask for it, and fails there as the search's."""
        self._say(f"timing the step at batch {batch_size} on the device, while the probes run")
        try:
            self._timed_beside = self._time_real(batch_size, repeats=3)
        except Exception:
            self._timed_beside = None

    def _time_within_budget(self, batch_size: int) -> tuple[Timing, float]:
        """(timing, scale) for `batch_size` when probes are fake: one real step timed, at the largest batch
        whose plain step the terms of the small batches put REAL_ROOM under the budget (every block
        checkpointed at the first small batch where none does), scaled linearly in the batch
        (docs/design.md §4)."""
        if self._real_timing is None:
            none = (0,) * len(self.units)

            def plain_fits(b: int) -> bool:
                t = self.fitted(b, self.b1, self.b2)
                return t.measured.get(none, predict(t, none)) <= (self.budget or 0) * (1 - REAL_ROOM)

            at = largest(plain_fits, self.b1)
            checkpoint = [] if at else list(self.units)
            at = at or self.b1
            t = self._timed_beside
            if t is None or checkpoint or not CLOSE_BATCH * at <= t.batch_size <= at:  # none beside, or far below
                self._say(f"timing the step at batch {at} on the device" + (", every block checkpointed" if checkpoint else ""))
                t = self._time_real(at, checkpoint=checkpoint, repeats=3)
            # checkpointed, the blocks' forwards ran twice: the plain step's time runs them once
            again = sum(t.forward_ms.get(u, 0.0) for u in checkpoint)
            self._real_timing = replace(t, step_ms=max(t.step_ms - again, 1e-9))
            self.notes.append(
                f"step times measured on the device at batch {t.batch_size}{' with every block checkpointed' if checkpoint else ''}"
                " and scaled linearly to other batches (the probes ran under fake tensors)"
            )
        return self._real_timing, batch_size / self._real_timing.batch_size

