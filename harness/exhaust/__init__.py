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
FULL: Final = "full"
PD_DECODE: Final = "pd-decode"
SCOPES: Final = (FULL, PD_DECODE)
MAX_REQUESTS_BY_SCOPE: Final = {FULL: MAX_REQUESTS, PD_DECODE: 3}
