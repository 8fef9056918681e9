"""Worker processes for the tiers of ``overlap-spec check``: one task per cell (or per
mutant and cell), run on ``--jobs`` processes, results back in task order.

Spawned, not forked: a worker shares no state with the parent (torch's thread pools, the
Hypothesis database, open files), so a task runs exactly as it would alone, and its
seed replays it in a single process. A result that cannot be pickled back (a crash
whose exception type does not pickle) returns with its error replaced by a
``WorkerError`` that keeps the type name and message: a crash stays a crash.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from types import FrameType
from typing import Any, TypeVar

Task = TypeVar("Task")
Result = TypeVar("Result")


_interrupt_requested = False


def _on_interrupt(signum: int, frame: FrameType | None) -> None:
    global _interrupt_requested
    _interrupt_requested = True
    raise KeyboardInterrupt


@contextmanager
def catching_interrupts() -> Iterator[None]:
    """Ctrl-C inside: a ``KeyboardInterrupt`` as usual, and remembered, because Python
    drops one that lands inside a garbage-collector callback (Hypothesis installs one)
    with "Exception ignored"; :func:`raise_if_interrupted` raises it again at the next
    task boundary, so an interrupt is never lost."""
    global _interrupt_requested
    _interrupt_requested = False
    previous = signal.signal(signal.SIGINT, _on_interrupt)
    previous_hook = sys.unraisablehook

    def unraisable(info: Any) -> None:
        if not isinstance(info.exc_value, KeyboardInterrupt):  # that one is re-raised
            previous_hook(info)

    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook
        _interrupt_requested = False


def raise_if_interrupted() -> None:
    if _interrupt_requested:
        raise KeyboardInterrupt


class WorkerError(Exception):
    """A crash from a worker process whose own exception could not be sent back."""


def get_default_jobs() -> int:
    """The CPUs this process may run on (the default of ``--jobs``)."""
    return max(len(os.sched_getaffinity(0)), 1) if hasattr(os, "sched_getaffinity") else 1


def _picklable(result: Any) -> Any:
    """``result``, with any attribute that will not pickle turned into a ``WorkerError``."""
    try:
        pickle.dumps(result)
        return result
    except Exception:  # noqa: BLE001 - whatever pickle raises, we repair below
        pass
    for name, value in list(getattr(result, "__dict__", {}).items()):
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001
            text = f"{type(value).__name__}: {value}"
            setattr(result, name, WorkerError(text) if isinstance(value, BaseException)
                    else text)
    return result


def _ignore_interrupts() -> None:
    """Ctrl-C is the parent's to handle: it reports what finished and stops the workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _call(function: Callable[[Any], Any], task: Any) -> Any:
    try:
        return _picklable(function(task))
    except Exception as error:
        # An exception whose constructor takes other arguments than its message (a
        # TraceFormatError) pickles but does not unpickle: sent back as it is, it would
        # break the whole pool; it comes back as a WorkerError that names it.
        try:
            pickle.loads(pickle.dumps(error))
        except Exception:  # noqa: BLE001 - whatever pickle raises, the crash is reported
            raise WorkerError(f"{type(error).__name__}: {error}") from None
        raise


# The workers of a `sharing_workers` block: (jobs, executor), or None.
_shared: tuple[int, ProcessPoolExecutor] | None = None


def _new_pool(workers: int) -> ProcessPoolExecutor:
    spawn = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(max_workers=workers, mp_context=spawn,
                               initializer=_ignore_interrupts)


def _stop(pool: ProcessPoolExecutor) -> None:
    """Ctrl-C (or a failed task): stop the workers now rather than wait for their
    running tasks; the executor offers no public way to do that."""
    for process in list((pool._processes or {}).values()):
        process.terminate()
    pool.shutdown(wait=False, cancel_futures=True)


@contextmanager
def sharing_workers(jobs: int) -> Iterator[None]:
    """Inside: every :func:`run_tasks` with these ``jobs`` runs on the same ``jobs``
    spawned workers (``check``'s tiers, one after another), so each worker imports torch,
    Hypothesis and z3 once, not once per tier. A task still shares nothing with the
    parent, and a tier's tasks already shared their workers."""
    global _shared
    if jobs <= 1 or _shared is not None:
        yield
        return
    pool = _new_pool(jobs)
    _shared = (jobs, pool)
    try:
        yield
    except BaseException:
        _stop(pool)
        raise
    else:
        pool.shutdown()
    finally:
        _shared = None


def run_tasks(function: Callable[[Task], Result], tasks: Iterable[Task], jobs: int,
              on_done: Callable[[Task, Result], None] | None = None) -> list[Result]:
    """``function(task)`` for every task, on ``jobs`` spawned processes (1: in this
    process, in order; inside :func:`sharing_workers`, its workers). ``on_done`` sees
    each result as it arrives (progress lines); the list comes back in task order
    whatever the finish order. ``function`` must be a module-level function (it is
    pickled by name)."""
    global _shared
    todo = list(tasks)
    results: dict[int, Result] = {}
    if jobs <= 1 or len(todo) <= 1:
        for index, task in enumerate(todo):
            results[index] = function(task)
            raise_if_interrupted()
            if on_done is not None:
                on_done(task, results[index])
    else:
        shared = _shared is not None and _shared[0] == jobs
        pool = _shared[1] if shared and _shared is not None else _new_pool(min(jobs, len(todo)))
        try:
            futures = {pool.submit(_call, function, task): index
                       for index, task in enumerate(todo)}
            for future in as_completed(futures):
                index = futures[future]
                results[index] = future.result()
                raise_if_interrupted()
                if on_done is not None:
                    on_done(todo[index], results[index])
        except BaseException:
            _stop(pool)
            if shared:
                _shared = None  # the later tiers get their own workers
            raise
        if not shared:
            pool.shutdown()
    return [results[index] for index in range(len(todo))]
