"""gpu_impl: the torch implementation of :class:`spec.interface.SchedulerModel`.

Not built yet (issue: gpu_impl with real streams and events). It will implement
the same Protocol as ``reference.scheduler.Scheduler`` so the one driver in
``harness/`` runs both.
"""

from spec.interface import SchedulerModel

__all__ = ["SchedulerModel"]
