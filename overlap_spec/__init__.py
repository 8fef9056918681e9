"""overlap-spec: the executable model of SGLang's overlap scheduler's seq_len and KV state.

One installed namespace. The packages live in the repository's top-level folders and are
reached from here (``overlap_spec/<name>`` links to ``<name>/``; a built wheel holds copies):

- ``overlap_spec.spec``      the state machine and its invariants (start at its ``__init__``);
- ``overlap_spec.reference`` the plain-Python scheduler operations;
- ``overlap_spec.gpu_impl``  the torch implementation with real streams and events;
- ``overlap_spec.proofs``    Z3 proofs and bounded model checking;
- ``overlap_spec.upstream``  sglang 0.5.23's own scheduler driven as a model;
- ``overlap_spec.harness``   the checkers, the CLI and the reports.
"""

__version__ = "0.1.0"
