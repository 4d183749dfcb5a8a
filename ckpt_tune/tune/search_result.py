"""What a search answers: `SearchResult`, and the frontier's rows (`FrontierRow`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ckpt_tune.plan.entry import Entry, to_data


@dataclass(frozen=True)
class FrontierRow:
    batch_size: int
    plan: tuple[Entry, ...]
    predicted_peak: int
    recompute_fraction: float
    fits: bool

    def to_dict(self) -> dict:
        """JSON form: entries as the plan file writes them."""
        return {**asdict(self), "plan": to_data(self.plan)}


@dataclass
class SearchResult:
    batch_size: int
    checkpoint: tuple[Entry, ...]
    predicted_peak: int
    verified_peak: int
    recompute_fraction: float
    budget: int
    units: tuple[str, ...]
    step_ms: float
    frontier: list[FrontierRow] = field(default_factory=list)
    baselines: dict[str, FrontierRow] = field(default_factory=dict)
    probes: int = 0  # recorded runs spent
    grad_accum_steps: int = 1
    notes: list[str] = field(default_factory=list)
    # units whose terms were not recorded but copied from an identical unit's (repeats.py) -> that unit
    extended_terms: dict[str, str] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)  # wall time per stage of the search
    # the plan's predicted peak before it was first run (None: not run by the search), and whether the
    # reported prediction was solved again on terms learned from that run (estimated segments measured)
    first_predicted_peak: int | None = None
    resolved: bool = False
    # probes recorded under fake tensors (the probe policy): of `probes`, those recorded for real; the real
    # steps run to time the step (warm-up included); the largest real recorded peak. None where every
    # step ran on the device
    real_steps: int | None = None
    timed_steps: int | None = None
    largest_real_peak: int | None = None
