"""The mutant matrix: ``select`` (which cells a bug runs in, the kill vocabulary),
``matrix`` (the Hypothesis and gpu_impl columns and the report), ``z3`` (the z3 column:
mutated BMC counterexamples replayed on the reference), ``minimize`` (shrinking a kill).
"""
