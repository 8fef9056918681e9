"""What a crash of an implementation is, as the checkers compare it.

A crash is never a pass. It is a kill only for a bug whose catalogue entry expects exactly
that crash (B25: before #19881 the scheduler raised where the release now aborts): the
exception's type, the function that raised it and words of its message must all match.
Any other crash stays what it was: inconclusive in ``check`` and the exhaustive tier, and
in the mutant matrix no kill (survived, with the crash named, in the Hypothesis column;
other-id in gpu_impl's).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass


@dataclass(frozen=True)
class Crash:
    exception: str  # the type's name
    function: str  # the innermost frame: the function that raised it
    message: str

    @classmethod
    def of(cls, error: BaseException) -> Crash:
        frames = traceback.extract_tb(error.__traceback__)
        return cls(type(error).__name__, frames[-1].name if frames else "?", str(error))

    @property
    def label(self) -> str:
        """The kill's name in the matrix: ``crash:ValueError@retract_decode``."""
        return f"crash:{self.exception}@{self.function}"

    def describe(self) -> str:
        return f"{self.exception} in {self.function}: {self.message}"

    def matches(self, found: Crash | None) -> bool:
        """``found`` is this expected crash: the same type and function, and this one's
        message (words the catalogue quotes) inside its message."""
        return (found is not None and found.exception == self.exception
                and found.function == self.function and self.message in found.message)
