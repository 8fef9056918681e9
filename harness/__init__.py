"""Drivers that connect spec, reference, gpu_impl and proofs (see ARCHITECTURE.md)."""

import warnings

# The CPU torch wheel warns at import when numpy is absent; nothing here uses numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
