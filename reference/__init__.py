"""The reference: a plain-Python scheduler built like upstream's, one method per upstream
method (``scheduler.py``: ``Scheduler``'s event loop, admission, chunked prefill,
retraction and result processing; ``schedule_batch.py``: ``ScheduleBatch``;
``mem_cache.py``, ``memory.py``: the pools and allocators; ``future_map.py``: the relay;
``worker.py``: the stand-in forward; ``runtime.py``: the context they share, the
configuration, pools, happens-before record, device tensors and faults).

Every per-request transition it makes (prepare, chunk, retract, finish, release) is the
spec's relation, applied through ``Req.apply`` (``req.py``): the arithmetic is
``spec/relation.py``'s, not rewritten here. ``refinement.py`` maps its state to the spec's
observations. The ``faults`` it takes (``spec.bugs.BUG_IDS``) re-introduce historical bugs.
"""
