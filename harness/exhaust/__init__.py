"""The small-scope exhaustive tier (``overlap-spec exhaust``): ``alphabet`` (each cell's
finite operation alphabet and the oracle that enumerates every distinguishable
iteration), ``search`` (breadth-first enumeration with state copies and a sound dedup
key), ``tier`` (cells across processes, saved counterexamples, report, JSON).

The depth and request bounds live here, with no imports, so that the command line's parser can
name them without loading the tier.
"""

from typing import Final

# Operations per sequence, per kind of cell: as deep as about a minute of one core allowed
# on the machine of bench/results/exhaust-20261125*.json (one level more costs 4-8 times as
# much without speculation, 10-25 times with it). With the release's new-token ratio in the
# state (bench/results/exhaust-20261126.json) the page-4 chain cells take about two.
NON_SPEC_DEPTH: Final = 5
SPEC_DEPTH: Final = 4
MAX_DEPTH: Final = 12
# Admissions per sequence (``--requests``): two by default; one for a kill that needs a
# single request but one operation more than the cell's depth.
MAX_REQUESTS: Final = 2
# The alphabets (``--alphabet``): ``full``, every kind of operation, the tier's default; and
# ``pd-decode``, the decode instance of PD disaggregation at the stream level: prebuilt
# admissions only, iterations that vary only the EOS position, up to three requests (a row
# reused while a forward still writes it needs a third). See ``alphabet``.
# And ``shared``, the radix cells' scope (their default): up to two requests of one prompt
# family, prompts of a page and one token (two under EAGLE), so the second shares the
# first's page of key whether it is prefilled with it (the checkpoint's dedup) or after it
# (a match), and iterations narrow enough for six operations.
FULL: Final = "full"
PD_DECODE: Final = "pd-decode"
SHARED: Final = "shared"
SCOPES: Final = (FULL, PD_DECODE, SHARED)
MAX_REQUESTS_BY_SCOPE: Final = {FULL: MAX_REQUESTS, PD_DECODE: 3, SHARED: MAX_REQUESTS}
# The shared alphabet's depth, in every radix cell: the match takes five operations under
# overlap (admit, prefill, its result, admit, prefill), so six reach past it (a release or
# a retraction of the matched request). From 3 to 26 s of CPU a cell, the spec overlap
# cells the most, about 4 minutes for the 16; one more level costs three to five times as
# much (bench/results/2026-11-29-exhaust-radix.md).
SHARED_DEPTH: Final = 6
