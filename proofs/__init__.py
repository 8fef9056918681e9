"""proofs: Z3 encodings of spec transitions (not built yet; see the proofs issue)."""
