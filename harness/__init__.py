"""The checkers, the command line and the reports: what connects spec, reference, gpu_impl,
proofs and upstream (ARCHITECTURE.md). Its parts, each a package or module:

- ``drive``         the invariant checker, operation scripts, the Hypothesis machine;
- ``differential``  gpu_impl against the reference;
- ``prove``         the Z3 proofs tier;
- ``mutants``       the mutant matrix (hypothesis, gpu_impl and z3 columns);
- ``trace``         the trace format: record, check, render, the live-SGLang shim;
- ``conformance``   sglang 0.5.23's own scheduler against the spec (the upstream tier);
- ``measure``       sync counts and benchmarks;
- ``vectors``       language-neutral conformance vectors;
- ``report``        the table and the JSON of ``check``;
- ``check``         ``overlap-spec check``: every tier, one report;
- ``cli``           the command line.

Imports go one way (tests/test_layers.py asserts there is no cycle): drive <- trace <-
differential/mutants/prove/conformance/vectors <- check <- cli.
"""

import warnings

# The CPU torch wheel warns at import when numpy is absent; nothing here uses numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
