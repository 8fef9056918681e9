"""The IDs of the historical bugs B1-B39, the faults an implementation can re-introduce.

A ``faults`` set of these IDs switches each bug's mechanism on in the relation
(``spec/relation.py``) and in the implementations; with none they are the intended design.
What each bug was, where it came from and where it applies is the mutant runner's
catalogue, ``harness/catalogue.py``, which lists exactly these IDs in this order.
"""

from __future__ import annotations

from typing import Final

BUG_IDS: Final = tuple(f"B{number}" for number in range(1, 40))

# B25's crash, raised by both implementations' retract_decode under the fault where the
# release aborts the last request (the catalogue's expected crash matches these words).
LAST_REQUEST_OOM: Final = ("retract_decode: out of memory with one request left, and none "
                           "to retract (B25: the crash before #19881)")
