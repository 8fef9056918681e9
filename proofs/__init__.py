"""proofs: Z3 encodings of the spec's transitions (``model.py``, lifted from the spec's
``compute_*`` functions by ``symbolic.py``), the invariants as Z3 claims (``claims.py``, the
spec's claims and cells read from ``spec.invariants``), inductive proofs (``induction.py``),
bounded model checking of K event-loop iterations (``bmc.py``; its loop in ``bmc_run.py``
and ``bmc_schedule.py``, one function per phase of ``reference/scheduler.py``, its checks
in ``bmc_checks.py``, its state record in ``bmc_state.py``), happens-before proofs of the
stream protocol (``streams.py``); ``solver.py`` reads verdicts (unknown is never proved).
See docs/proofs.md."""
