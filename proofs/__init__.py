"""proofs: Z3 encodings of the spec's transitions (``model.py``, lifted from the spec's
``compute_*`` functions by ``symbolic.py``), the invariants as Z3 claims (``claims.py``),
inductive proofs (``induction.py``), bounded model checking of K event-loop iterations
(``bmc.py``), happens-before proofs of the stream protocol (``streams.py``); ``solver.py``
reads verdicts (unknown is never proved). See docs/proofs.md."""
