"""proofs: Z3 encodings of the spec's transitions (lifted from spec/transitions.py),
inductive proofs (induction.py), happens-before proofs of the stream protocol
(streams.py). See docs/proofs.md."""
