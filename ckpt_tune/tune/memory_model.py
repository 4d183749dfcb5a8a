"""The memory model of docs/design.md §4: predicted peak of any checkpoint plan, from a few recorded runs.

Blocks u_0..u_{n-1} run in this order in forward and in reverse in backward. Cut the live-byte curve of
one iteration at the blocks' markers:

    prefix      P_i = live(f>u_i) - live(f>u_0)                   (what blocks before i still store)
    stored      d_i = live(f>u_{i+1}) - live(f>u_i)                 (P_{i+1} = P_i + d_i)
    forward     F_i = max live over [f>u_i, f>u_{i+1}) - live(f>u_i)    (the last block's region runs to
                                                                      its backward: loss/logits spike)
    backward    B_i = max live over [b>u_i, b>u_{i-1}) - live(f>u_0) - P_i
    fixed       C   = max live before f>u_0 and after the backward (embedding, optimizer step)

    peak(s) = static + live(f>u_0) + max(C', max_i [P_i(s) + F_i], max_i [P_i(s) + B_i])

Every term of block i depends only on its own choice s_i and its predecessor's s_{i-1} (a block that
does not keep its input frees its predecessor's output; a predecessor ending in an op that saves its own
output overlaps with it). Four runs (none, all, even, odd checkpointed) observe all four (s_{i-1}, s_i)
pairs of every block, so the model is exact wherever block terms are additive like this. Terms are
linear in batch size; `Terms.interpolate` fits them from two batch sizes.

Finer options (checkpoint only a block's `attn` or `mlp`) are options 2, 3, … of every block. One more
run per option (every block takes it) observes the pair (option, option); the other pairs assume what
holds for sub-module checkpointing: the block still keeps its own input and output as when stored
normally, so its predecessor interacts with it as with option 0 (see `combine`). Verification by
running the plan (searcher.py) guards that assumption.

Segments (consecutive blocks i..j under one checkpoint, ckpt_tune/plan/segment.py) are terms of their own:
d, F, B of the whole run i..j for each option p of block i-1, keyed (i, j) in `Terms.segments`. The
block after a segment sees it as a checkpointed predecessor (its pair terms with prev = 1): in both
cases nothing of the predecessor's is stored. Until a run with that segment is recorded, its terms are
estimated from the blocks' pair terms (`estimate_segments`); `segment_terms` takes them from a recorded
run, which the search does for every plan it verifies.

Everything here is pure: no device, no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ckpt_tune.plan.entry import Entry
from ckpt_tune.plan.kinds import kind_of, neighbour_like, policy_of

# Options of a block: 0 = stored normally, 1 = the whole block checkpointed, 2.. = the finer options of
# the kinds offered (Terms.options names them; plan/kinds/ says what each is).


@dataclass(frozen=True)
class BlockTerms:
    """d, F, B of one block for each (s_prev, s_own) pair, indexed by pair_index(s_prev, s_own, K)."""

    d: tuple[int, ...]
    F: tuple[int, ...]
    B: tuple[int, ...]


@dataclass(frozen=True)
class SegmentTerms:
    """d, F, B of a segment for each option p of the block before it (indexed by p); `measured` holds
    the p whose terms come from a recorded run with this segment, not from `estimate_segments`."""

    d: tuple[int, ...]
    F: tuple[int, ...]
    B: tuple[int, ...]
    measured: frozenset[int] = frozenset()


# In a choice, a segment i..j is coded -(j - i + 1) at i (its length) and SEGMENT_MEMBER after it.
SEGMENT_MEMBER = -1


def segments_of(choice: tuple[int, ...]) -> list[tuple[int, int]]:
    """(first, last) of every segment in a choice."""
    return [(i, i - c - 1) for i, c in enumerate(choice) if c < SEGMENT_MEMBER]


def segment_code(i: int, j: int) -> tuple[int, ...]:
    """The choice entries of blocks i..j checkpointed as one segment."""
    return (-(j - i + 1), *(SEGMENT_MEMBER,) * (j - i))


def with_segment(choice: tuple[int, ...], i: int, j: int) -> tuple[int, ...]:
    return (*choice[:i], *segment_code(i, j), *choice[j + 1 :])


def plan_entries(units, options, choice: tuple[int, ...], groups: dict[tuple[int, int], str] | None = None) -> tuple[Entry, ...]:
    """Plan entries for a choice (docs/design.md §7): the block for option 1, the block under its
    policy for a policy option, `block.<sub>` for a sub-module option (one entry per sub-module of an
    option named `a+b`), for a run i..j the group module whose units they are (`groups`), else the
    run of the blocks' names (a segment)."""
    out: list[Entry] = []
    for i, (u, c) in enumerate(zip(units, choice)):
        if c < SEGMENT_MEMBER:
            group = (groups or {}).get((i, i - c - 1))
            out.append(Entry((group,)) if group else Entry(tuple(units[i : i - c])))
        elif c >= 1:
            out.extend(map(Entry.of, kind_of(options, c).entries(u, options[c])))
    return tuple(out)


# Terms of an option a block does not have (a sub-module it lacks): no plan can afford it.
UNAVAILABLE = 1 << 60


@dataclass(frozen=True)
class Terms:
    batch_size: int
    units: tuple[str, ...]
    static: int  # params + buffers + optimizer state, live all iteration
    base: int  # live(f>u_0) above static: the batch and everything before the first block
    fixed: int  # max live above static outside the blocks' regions (before u_0, optimizer step)
    blocks: tuple[BlockTerms, ...]
    measured: dict[tuple[int, ...], int] = field(default_factory=dict, compare=False)  # config -> peak
    options: tuple[str, ...] = ("none", "block")  # option k >= 2 checkpoints sub-module options[k] of each block
    segments: dict[tuple[int, int], SegmentTerms] = field(default_factory=dict, compare=False)
    # runs (i, j) that are all the units of one group module: checkpointed as that module (candidates.py)
    groups: dict[tuple[int, int], str] = field(default_factory=dict, compare=False)

    @property
    def k(self) -> int:
        return len(self.options)

    def names(self, choice: tuple[int, ...]) -> tuple[Entry, ...]:
        return plan_entries(self.units, self.options, choice, self.groups)

    def interpolate(self, other: Terms, batch_size: int) -> Terms:
        """Terms at another batch size, linear through self and other, rounded up (a line, not a bound:
        out of sample it can come out low; the search probes the batch it answers, docs/design.md §4).

        Only measured terms are fitted. A segment's term estimated from its blocks (`estimate_segments`)
        is a maximum over them, which block holds it can change with the batch, and a line through two
        maxima is low past them: it is estimated again from the fitted blocks."""
        b1, b2 = self.batch_size, other.batch_size

        def lin(x1: int, x2: int) -> int:
            num = x1 * (b2 - batch_size) + x2 * (batch_size - b1)
            return -((-num) // (b2 - b1))  # ceiling division

        def tup(a, b):
            return tuple(lin(x, y) for x, y in zip(a, b, strict=False))

        blocks = tuple(
            BlockTerms(tup(p.d, q.d), tup(p.F, q.F), tup(p.B, q.B)) for p, q in zip(self.blocks, other.blocks, strict=False)
        )
        fitted = Terms(
            batch_size, self.units, self.static, lin(self.base, other.base), lin(self.fixed, other.fixed), blocks,
            options=self.options, groups=self.groups,
        )
        keys = [key for key in self.segments if key in other.segments]
        estimated = estimate_segments(fitted, keys)
        segments = {}
        for key in keys:
            seg, o, est = self.segments[key], other.segments[key], estimated[key]
            both = seg.measured & o.measured

            def pick(a, b, e, both=both):
                return tuple(lin(x, y) if p in both else z for p, (x, y, z) in enumerate(zip(a, b, e, strict=True)))

            segments[key] = SegmentTerms(pick(seg.d, o.d, est.d), pick(seg.F, o.F, est.F), pick(seg.B, o.B, est.B), both)
        return replace(fitted, segments=segments)


def pair_index(prev: int, own: int, k: int = 2) -> int:
    return prev * k + own


def price_out(terms: Terms, options) -> Terms:
    """The same terms with no block able to take any of `options` (indices): UNAVAILABLE bytes for
    every pair where a block takes one. Segment terms, estimated before, are kept."""
    K = terms.k
    off = {pair_index(p, o, K) for p in range(K) for o in options}
    if not off:
        return terms

    def cut(xs: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(UNAVAILABLE if j in off else x for j, x in enumerate(xs))

    return replace(terms, blocks=tuple(BlockTerms(cut(b.d), cut(b.F), cut(b.B)) for b in terms.blocks))


def policy_options(terms: Terms) -> list[int]:
    """Indices of the op-policy options of `terms`."""
    return [k for k, name in enumerate(terms.options) if policy_of(name) is not None]


def predict(terms: Terms, choice: tuple[int, ...]) -> int:
    """Predicted peak bytes of the iteration with block i taking option choice[i] (segments coded as
    `with_segment` does)."""
    top = terms.fixed - terms.base
    prefix, prev, i = 0, 0, 0
    while i < len(terms.blocks):
        c = choice[i]
        if c < SEGMENT_MEMBER:
            seg = terms.segments[(i, i - c - 1)]
            top = max(top, prefix + seg.F[prev], prefix + seg.B[prev])
            prefix += seg.d[prev]
            prev, i = 1, i - c
            continue
        blk = terms.blocks[i]
        k = pair_index(prev, c, terms.k)
        top = max(top, prefix + blk.F[k], prefix + blk.B[k])
        prefix += blk.d[k]
        prev, i = c, i + 1
    return terms.static + terms.base + top


def estimate_segments(terms: Terms, keys) -> dict[tuple[int, int], SegmentTerms]:
    """Terms of the segments `keys` ((first, last) pairs) estimated from the blocks' pair terms.

    Forward: block i runs as when checkpointed alone; each later block as a checkpointed block after a
    checkpointed one, except that the segment does not hold its input: what stays stored across block
    k is d_k(1,1) - d_{k-1}(1,1) (its output replaces its input). Backward: the whole run is recomputed,
    so while block k runs backward the blocks before it in the segment hold what they store when not
    checkpointed, d(0,0), under block k's own checkpointed backward term B_k(1,1). A segment measured
    by `segment_terms` replaces its estimate.
    """
    K, one = terms.k, pair_index(1, 1, terms.k)
    none = pair_index(0, 0, K)
    out = {}
    for i, j in keys:
        blocks = terms.blocks
        ds, fs, bs = [], [], []
        for p in range(K):
            head = blocks[i]
            live, top_f = head.d[pair_index(p, 1, K)], head.F[pair_index(p, 1, K)]
            for k in range(i + 1, j + 1):
                top_f = max(top_f, live + blocks[k].F[one])
                live += blocks[k].d[one] - blocks[k - 1].d[one]
            held, top_b = head.d[pair_index(p, 0, K)], head.B[pair_index(p, 1, K)]
            for k in range(i + 1, j + 1):
                top_b = max(top_b, held + blocks[k].B[one])
                held += blocks[k].d[none]
            ds.append(live)
            fs.append(top_f)
            bs.append(top_b)
        out[(i, j)] = SegmentTerms(tuple(ds), tuple(fs), tuple(bs))
    return out


def segment_terms(cut: RunCut, i: int, j: int, prev: int, k: int, known: SegmentTerms | None) -> SegmentTerms:
    """A segment's terms for predecessor option `prev`, read from a recorded run that had it (the
    run's cut at its blocks' markers), on top of what is known for the other predecessor options."""
    d, f, b = 0, cut.F[i], cut.B[i]
    for m in range(i, j + 1):
        f, b = max(f, d + cut.F[m]), max(b, d + cut.B[m])
        d += cut.d[m]
    base = known or SegmentTerms((d,) * k, (f,) * k, (b,) * k)

    def put(xs: tuple[int, ...], x: int) -> tuple[int, ...]:
        return (*xs[:prev], x, *xs[prev + 1 :])

    return SegmentTerms(put(base.d, d), put(base.F, f), put(base.B, b), base.measured | {prev})


def probe_configs(n: int, k: int = 2, has=None) -> dict[str, tuple[int, ...]]:
    """Runs that observe every (s_prev, s_own) pair of options 0/1, and (k, k) of each finer option.
    `has(i, option)`: whether block i has that finer option (a block without it stays stored in its run)."""
    runs = {
        "none": (0,) * n,
        "all": (1,) * n,
        "even": tuple(1 - (i % 2) for i in range(n)),
        "odd": tuple(i % 2 for i in range(n)),
    }
    for opt in range(2, k):
        runs[f"option{opt}"] = tuple(opt if has is None or has(i, opt) else 0 for i in range(n))
    return runs


@dataclass(frozen=True)
class RunCut:
    """The per-block cut of one recorded run (see module docstring), relative to live(f>u_0)."""

    choice: tuple[int, ...]
    base: int
    fixed: int
    d: tuple[int, ...]
    F: tuple[int, ...]
    B: tuple[int, ...]
    peak_above_static: int
    before: int = 0  # max live before f>u_0 (fixed = max(before, after))
    after: int = 0  # max live from the end of backward through the optimizer step


def with_step_of(cut: RunCut, after: int) -> RunCut:
    """A cut recorded without its optimizer step, given the step's moments (`after`) of the
    no-checkpointing run at its batch: after backward every configuration holds the same tensors
    (the gradients, the batch, the loss), so the step's live bytes are the same (docs/design.md §4)."""
    return replace(cut, after=after, fixed=max(cut.before, after), peak_above_static=max(cut.peak_above_static, after))


def cut_run(live_at, max_between, markers: dict[str, list[int]], units: tuple[str, ...], choice, pick: int = 0) -> RunCut:
    """Cut one run's live curve at the blocks' markers. `live_at(t)`, `max_between(t0, t1)` read the curve.

    `pick`: which micro-batch of an accumulated iteration to cut at (-1: the last). The cut starts at
    that micro-batch: an earlier one holds the same tensors but fewer gradients, so it never peaks
    higher (verification measures the whole iteration anyway)."""
    n = len(units)
    t_f = [markers["f>" + u][pick] for u in units]
    t_b = [markers["b>" + u][pick] for u in units]
    t_iter, t_bwd_end, t_end = markers["iter"][0], markers["backward"][pick], markers["step"][0]
    if pick != 0 and markers.get("micro"):
        t_iter = markers["micro"][pick]
    peak = max_between(t_iter, t_end + 1)[0]
    if n == 0:  # nothing to cut at (no module runs once as a unit): the whole iteration is fixed
        return RunCut(tuple(choice), 0, peak, (), (), (), peak, peak, peak)
    base = live_at(t_f[0])
    d, F, B = [], [], []
    for i in range(n):
        t0 = t_f[i]
        t1 = t_f[i + 1] if i + 1 < n else t_b[n - 1]
        lv = live_at(t0)
        F.append(max_between(t0, t1)[0] - lv)
        d.append((live_at(t_f[i + 1]) - lv) if i + 1 < n else 0)
    prefix = [0]
    for x in d[:-1]:
        prefix.append(prefix[-1] + x)
    for i in range(n):
        t0 = t_b[i]
        t1 = t_b[i - 1] if i > 0 else t_bwd_end
        B.append(max_between(t0, t1)[0] - base - prefix[i])
    before, after = max_between(t_iter, t_f[0])[0], max_between(t_bwd_end, t_end + 1)[0]
    return RunCut(tuple(choice), base, max(before, after), tuple(d), tuple(F), tuple(B), peak, before, after)


def combine(
    cuts: list[RunCut], units: tuple[str, ...], static: int, batch_size: int, options: tuple[str, ...] = ("none", "block")
) -> Terms:
    """Assemble Terms from the probe runs: each block's pair terms from the run that shows that pair.

    Pairs no run shows involve a finer option (k >= 2), which looks to its neighbours like a basic
    option a = neighbour_like(k) (0 for a sub-module option, 1 for a policy option): (p, k) is the pair
    its run showed, (p0, k), shifted by how the predecessor changes option a: + (p', a) - (p0', a), with
    p' = neighbour_like(p); and (k, q) = (a, q) for q in {0, 1}. A block whose runs never show option k
    (it has no such sub-module) gets UNAVAILABLE terms for it.
    """
    n, K = len(units), len(options)
    blocks = []
    for i in range(n):
        vals: dict[tuple[int, int], tuple[int, int, int]] = {}
        for c in cuts:
            own = c.choice[i]
            prevs = [c.choice[i - 1]] if i > 0 else list(range(K))  # block 0 has no predecessor
            for prev in prevs:
                vals.setdefault((prev, own), (c.d[i], c.F[i], c.B[i]))
        for prev, own in [(0, 0), (0, 1), (1, 0), (1, 1)]:
            if (prev, own) not in vals:
                raise ValueError(f"probe runs miss pair {(prev, own)} of block {units[i]}")

        for own in range(2, K):
            a = neighbour_like(options, own)
            seen = [p for p in range(K) if (p, own) in vals]
            if not seen:  # block i lacks this option: priced out
                for prev in range(K):
                    vals[(prev, own)] = (UNAVAILABLE,) * 3
            else:
                p0 = own if own in seen else seen[0]  # the pair the option's run showed
                ref = vals[(neighbour_like(options, p0), a)]
                for prev in range(K):
                    step = vals[(neighbour_like(options, prev), a)]
                    vals.setdefault((prev, own), tuple(x + y - z for x, y, z in zip(vals[(p0, own)], step, ref)))
            for q in (0, 1):
                vals.setdefault((own, q), vals[(a, q)])
        order = [(p, o) for p in range(K) for o in range(K)]
        blocks.append(BlockTerms(*(tuple(vals[po][j] for po in order) for j in range(3))))
    base = max(c.base for c in cuts)
    fixed = max(c.fixed for c in cuts)
    return Terms(
        batch_size, units, static, base, fixed, tuple(blocks),
        {c.choice: static + c.peak_above_static for c in cuts}, options,
    )
