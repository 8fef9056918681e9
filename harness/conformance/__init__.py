"""sglang 0.5.23's own scheduler against the spec: ``findings`` (what upstream is known to
do and the allowed divergences), ``tier`` (one cell in its own process, the
reference-vs-upstream differential) and ``cli`` (``overlap-spec upstream``).
"""
