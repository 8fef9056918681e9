"""The worker processes of ``check``'s tiers (harness/pool.py)."""

from __future__ import annotations

import os

import pytest

from overlap_spec.harness.pool import run_tasks, sharing_workers


def get_pid(task: int) -> tuple[int, int]:
    return task, os.getpid()


def fail_on_three(task: int) -> int:
    if task == 3:
        raise ValueError("task 3")
    return task


def test_tiers_inside_sharing_workers_run_on_the_same_workers() -> None:
    """Two tiers in one block: results in task order, computed away from this process,
    and the second tier on the first one's workers (each imports torch once)."""
    with sharing_workers(2):
        first = run_tasks(get_pid, range(6), 2)
        second = run_tasks(get_pid, range(6), 2)
    assert [task for task, _ in first] == list(range(6))
    assert [task for task, _ in second] == list(range(6))
    workers = {pid for _, pid in first}
    assert os.getpid() not in workers and 1 <= len(workers) <= 2
    assert {pid for _, pid in second} <= workers
    # Outside a block each call has its own workers.
    again = run_tasks(get_pid, range(4), 2)
    assert not {pid for _, pid in again} & workers


def test_a_failed_tier_leaves_the_next_one_its_own_workers() -> None:
    """A task that raises stops its tier (the error reaches the caller) and the shared
    workers with it; a later tier in the same block still runs, on new workers."""
    with sharing_workers(2):
        with pytest.raises(ValueError, match="task 3"):
            run_tasks(fail_on_three, range(6), 2)
        assert run_tasks(fail_on_three, [0, 1, 2], 2) == [0, 1, 2]


def fail_unpicklably(task: int) -> int:
    from overlap_spec.harness.trace.format import TraceFormatError

    raise TraceFormatError(task, "state.tree", "no decoder")


def test_an_exception_that_cannot_come_back_is_reported_not_a_broken_pool() -> None:
    """A worker's exception whose constructor takes more than its message does not
    unpickle: it comes back as a WorkerError naming it, and the pool is not broken (a
    check run crashed with BrokenProcessPool on a TraceFormatError)."""
    from overlap_spec.harness.pool import WorkerError

    with sharing_workers(2):
        with pytest.raises(WorkerError, match="TraceFormatError: line 3, field 'state.tree'"):
            run_tasks(fail_unpicklably, [3, 3], 2)
        assert run_tasks(fail_on_three, [0, 1], 2) == [0, 1]
