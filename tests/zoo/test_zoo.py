"""The conformance zoo: ckpt-tune on models written by others (tests/zoo/members.py), four checks each
(tests/zoo/checks.py): profile exact to the byte, --device meta within 1% (or a clean refusal), search's
plan within its budget at a batch no smaller than every innermost block reaches, and plans that change
nothing but memory and time.

Ground truth is tests/harness.py. Which tests are slow or heavy is set per member in members.py:
`make test` runs all but heavy, `make zoo` runs them all plus benchmarks/zoo.py.
"""

from __future__ import annotations

import pytest

from tests.zoo import checks
from tests.zoo.checks import META_TOLERANCE, truth
from tests.zoo.members import MEMBERS, Member


def _params(speed_of, only=lambda m: True):
    out = []
    for m in MEMBERS.values():
        if not only(m):
            continue
        speed = speed_of(m)
        marks = {"fast": [], "slow": [pytest.mark.slow], "heavy": [pytest.mark.heavy, pytest.mark.slow]}[speed]
        if m.family in ("transformers", "peft"):
            marks = [*marks, pytest.mark.hf]
        out.append(pytest.param(m, id=m.name, marks=marks))
    return out


EVERY = _params(lambda m: m.speed)
SEARCH = _params(lambda m: m.search_speed)
META_RUNS = _params(lambda m: m.speed, lambda m: m.meta_limitation is None)
META_REFUSED = _params(lambda m: m.speed, lambda m: m.meta_limitation is not None)


def test_members_name_real_innermost_blocks():
    """Every hand-written block exists, none contains another, and each has a sibling of its own type."""
    from tests.zoo.members import parts

    for m in MEMBERS.values():
        model = parts(m)[0]()
        names = m.blocks
        assert len(names) == len(set(names)) >= 2, m.name
        for n in names:
            mod = model.get_submodule(n)
            assert not any(o != n and o.startswith(n + ".") for o in names), f"{m.name}: {n} holds another block"
            parent = model.get_submodule(n.rpartition(".")[0]) if "." in n else model
            same = [c for c in parent.children() if type(c) is type(mod)]
            assert len(same) >= 2, f"{m.name}: {n} is not repeated in its container"


# -- 1. profile, exact to the byte --------------------------------------------------------------------
@pytest.mark.parametrize("member", EVERY)
def test_profile_peak_equals_harness(member: Member):
    want = truth(member.name, member.profile_batch)
    got = checks.profiled_peak(member)
    assert got == want, f"{member.name}: ckpt-tune profile {got:,} B vs harness {want:,} B ({got - want:+,} B)"


def test_profile_command_json_equals_harness():
    """The same through `ckpt-tune profile tests/zoo/<file>.py:<build> --device cpu --json`."""
    member = MEMBERS["gru_lm"]
    assert checks.profiled_peak(member, via_cli=True) == truth(member.name, member.profile_batch)


# -- 2. fake tensors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("member", META_RUNS)
def test_meta_within_one_percent_of_cpu_allocator(member: Member):
    want = truth(member.name, member.profile_batch)
    got = checks.fake_peak(member, "cpu")
    err = (got - want) / want
    assert abs(err) <= META_TOLERANCE, f"{member.name}: fake tensors {got:,} B vs CPU allocator {want:,} B ({err:+.2%})"


def test_device_meta_runs_from_the_command_line():
    """`ckpt-tune profile <zoo target> --device meta` as a user types it (a CUDA step's size)."""
    p = checks.meta_profile_cli(MEMBERS["tv_vit"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("member", META_REFUSED)
def test_meta_refuses_cleanly_where_fake_tensors_cannot_run(member: Member, record_property):
    """A model fake tensors cannot run: `ckpt-tune profile --device meta` exits 1 with one clear line
    saying so, and no traceback. The limitation is recorded in the test report."""
    record_property("meta_limitation", member.meta_limitation)
    p = checks.meta_profile_cli(member)
    assert p.returncode == 1, f"exit {p.returncode}: {p.stderr[-2000:]}"
    assert "Traceback" not in p.stderr, p.stderr[-4000:]
    lines = checks.error_lines(p.stderr)
    assert len(lines) == 1, p.stderr[-2000:]
    assert "fake tensors" in lines[0], f"the message should say fake tensors cannot run it: {lines[0]}"


# -- 3. search ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("member", SEARCH)
def test_search_plan_fits_and_reaches_the_every_block_batch(member: Member):
    out = checks.searched(member.name)
    assert out.grad_accum_steps == 1, out
    measured = truth(member.name, out.batch_size, out.checkpoint)
    assert measured <= out.budget, (
        f"{member.name}: plan {list(out.checkpoint)} at batch {out.batch_size} measured {measured:,} B "
        f"> budget {out.budget:,} B (+{measured - out.budget:,} B)")
    # no real step of the search went past the budget (on a device of its size, an out-of-memory error)
    assert out.largest_real_peak is None or out.largest_real_peak <= out.budget, (out.largest_real_peak, out.budget)
    every = checks.every_block_batch(member, out.budget)
    assert every >= member.budget_batch  # the budget was made from it
    assert out.batch_size >= every, (
        f"{member.name}: search found batch {out.batch_size} (plan {list(out.checkpoint)}, candidates "
        f"{out.candidates}); every innermost block reaches batch {every} within {out.budget:,} B")


# -- 4. invariants --------------------------------------------------------------------------------------
@pytest.mark.parametrize("member", EVERY)
def test_every_innermost_block_plan_changes_nothing_but_memory(member: Member):
    diffs = checks.invariant_differences(member, member.blocks)
    assert not diffs, f"{member.name}: " + "; ".join(diffs[:10])


@pytest.mark.parametrize("member", SEARCH)
def test_search_plan_changes_nothing_but_memory(member: Member):
    out = checks.searched(member.name)
    diffs = checks.invariant_differences(member, out.checkpoint)
    assert not diffs, f"{member.name} with {list(out.checkpoint)}: " + "; ".join(diffs[:10])

