"""fork_map (ckpt_tune/measure/forked.py): items taken from a queue by forked processes come back in
order, a failure raises as a loop's would, a child that dies has its items run here, and the number of
processes follows the cores, the items, the RAM and CKPT_TUNE_WORKERS. fork_ahead: one call under way in
a child while this process goes on, its value or None, and no child left behind."""

from __future__ import annotations

import os
import sys
import time

import pytest

from ckpt_tune.errors import CkptTuneError
from ckpt_tune.measure import forked
from ckpt_tune.measure.forked import WORKERS_ENV, cores_left, fork_ahead, fork_map, usable_workers

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork is used on Linux only")

PARENT = os.getpid()


def _where(x):
    """(x, whether this process is the test's own)."""
    return x, os.getpid() == PARENT


class Refused(Exception):
    pass


def _fails_at(bad):
    def fn(x):
        if x == bad:
            try:
                raise ValueError(f"item {x}")
            except ValueError as e:
                raise Refused(str(x)) from e
        return x

    return fn


def _slow_pid(x):
    time.sleep(0.2)  # long enough for every process to take items from the queue
    return x, os.getpid()


def test_results_come_back_in_item_order_from_every_process():
    got = fork_map(_slow_pid, list(range(7)), 3)
    assert [x for x, _ in got] == list(range(7))
    pids = {pid for _, pid in got}
    assert PARENT in pids
    assert len(pids) > 1


def test_items_kept_here_run_in_this_process_first():
    got = fork_map(_slow_pid, list(range(4)), 2, here=[2])
    assert got[2] == (2, PARENT)
    assert [x for x, _ in got] == list(range(4))


def test_items_run_first_run_here_before_any_child_which_starts_with_what_they_left():
    seen: list[int] = []

    def cached(x):
        seen.append(x)  # a cache of this process's: a child copies what it holds when forked
        time.sleep(0.2)  # long enough for every process to take items from the queue
        return os.getpid(), list(seen)

    got = fork_map(cached, list(range(6)), 2, first=[3])
    assert got[3] == (PARENT, [3])  # before anything else, here
    children = [s for pid, s in got if pid != PARENT]
    assert children
    assert all(s[0] == 3 for s in children)


def test_a_first_item_that_raises_raises_before_any_child_is_forked():
    with pytest.raises(Refused, match="1") as info:
        fork_map(_fails_at(1), [0, 1, 2, 3], 2, first=[1])
    assert isinstance(info.value.__cause__, ValueError)


def test_one_worker_is_a_plain_loop_in_this_process():
    assert fork_map(_where, [1, 2, 3], 1) == [(1, True), (2, True), (3, True)]


@pytest.mark.parametrize("bad", [1, 2])  # in a child's share, in this process's share
def test_the_first_failure_in_item_order_raises_with_its_cause(bad):
    with pytest.raises(Refused, match=str(bad)) as info:
        fork_map(_fails_at(bad), [0, 1, 2, 3], 2)
    assert isinstance(info.value.__cause__, ValueError)


def test_the_items_of_a_child_that_dies_run_in_this_process():
    def dies_in_a_child(x):
        if os.getpid() != PARENT:
            os._exit(3)
        time.sleep(0.1)  # the child takes an item before this process takes them all
        return _where(x)

    assert fork_map(dies_in_a_child, [0, 1, 2, 3], 2) == [(0, True), (1, True), (2, True), (3, True)]


def test_no_child_outlives_the_call():
    fork_map(_where, list(range(4)), 4)
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)


def test_workers_follow_the_items_the_ram_and_the_environment(monkeypatch):
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    monkeypatch.setattr(forked, "host_headroom", lambda: 100 << 30)
    cores = len(os.sched_getaffinity(0))
    assert usable_workers(64, 1 << 20) == min(64, cores)
    assert usable_workers(1, 1 << 20) == 1
    monkeypatch.setattr(forked, "host_headroom", lambda: 0)  # no room for a copy of this process
    assert usable_workers(64, 1 << 20) == 1
    monkeypatch.setattr(forked, "host_headroom", lambda: 100 << 30)
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert usable_workers(64, 1 << 20) == 3
    monkeypatch.setenv(WORKERS_ENV, "many")
    with pytest.raises(CkptTuneError, match=WORKERS_ENV):
        usable_workers(64, 1 << 20)


def test_costs_put_the_longest_items_first_in_the_queue_and_results_stay_in_item_order():
    costs = [1.0, 1.0, 5.0, 1.0, 2.0, 1.0, 1.0]
    assert forked.queue_order(7, costs) == [2, 4, 0, 1, 3, 5, 6]
    assert forked.queue_order(3) == [0, 1, 2]
    got = fork_map(_slow_pid, list(range(7)), 2, costs)
    assert [x for x, _ in got] == list(range(7))


def test_a_runner_freezes_what_lives_when_it_starts_and_fork_map_leaves_it_frozen():
    """The collection before each recorded step scans only what the steps make (runner.StepRunner):
    what is alive when a runner starts stays frozen until it ends, a share-out does not thaw it, and a
    freeze its caller made is the caller's to undo."""
    import gc

    import torch

    from ckpt_tune.measure.runner import StepRunner, StepSettings

    def runner() -> StepRunner:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        return StepRunner(model, lambda n: torch.randn(n, 8), lambda m, x: m(x).square().mean(), StepSettings(device="cpu"))

    gc.unfreeze()  # a runner an earlier test entered and left open froze objects: only the collector's work
    with runner() as r:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        assert [x for x, _ in fork_map(_where, [1, 2], 2)] == [1, 2]
        assert gc.get_freeze_count() >= frozen
        assert r.measure(4).peak_bytes > 0
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        mine = gc.get_freeze_count()
        with runner():
            pass
        assert gc.get_freeze_count() >= mine
    finally:
        gc.unfreeze()


def _no_child_left() -> None:
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)


def test_a_call_ahead_runs_in_a_child_while_this_process_goes_on():
    t0 = time.perf_counter()
    ahead = fork_ahead(lambda: (time.sleep(0.3), os.getpid())[1])
    assert time.perf_counter() - t0 < 0.3  # not waited for
    pid = ahead.result()
    assert pid not in (None, PARENT)
    assert ahead.result() is None  # taken once
    _no_child_left()


def test_a_call_ahead_that_raises_or_dies_gives_none():
    def raises():
        raise ValueError("no")

    assert fork_ahead(raises).result() is None
    assert fork_ahead(lambda: os._exit(0)).result() is None  # exited without an answer
    _no_child_left()


def test_a_call_ahead_closed_unread_leaves_no_child_and_a_forked_copy_does_not_take_it():
    ahead = fork_ahead(lambda: time.sleep(30))
    # a forked copy of this process holds the same handle: it is not its child, and it neither reads nor ends it

    def copy_reads(_x):
        if os.getpid() == PARENT:
            time.sleep(0.2)  # the forked copy takes the other item
            return "here"
        ahead.close()
        return ahead.result()

    assert sorted(fork_map(copy_reads, [0, 1], 2), key=str) == [None, "here"]
    t0 = time.perf_counter()
    ahead.close()
    assert time.perf_counter() - t0 < 5
    assert ahead.result() is None
    _no_child_left()


def test_cores_left_count_whole_cores_beside_a_steps_threads():
    cores = len(os.sched_getaffinity(0))
    assert 0 <= cores_left(1) <= cores - 1
    assert cores_left(cores) == 0
