"""gpu_impl: the torch implementation of :class:`spec.interface.SchedulerModel`.

State lives in torch tensors on a device (CUDA when available, else CPU) and the stream
design is upstream's (``gpu_impl/streams.py``); on CPU the streams are virtual and
``gpu_impl/race.py`` judges their ordering. ``harness/differential/compare.py`` drives it in
lock step with ``reference.scheduler.Scheduler``. Start at ``gpu_impl/scheduler.py``.
"""

from overlap_spec.spec.interface import SchedulerModel

__all__ = ["SchedulerModel"]
