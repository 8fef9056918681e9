"""The project's Hypothesis state machines as pytest tests: HypoFuzz's fuzz targets.

One ``TestCase`` per configuration cell (minimal preset), each the machine
``harness/drive/stateful.py`` builds for ``overlap-spec check``: admit, admit_prebuilt,
iterate and abort on the reference, every applicable invariant checked at every
observation point. ``check`` runs them for a fixed budget under a fixed seed; HypoFuzz
(``pip install -e '.[fuzz]'``) runs them for as long as it is left, guided by coverage:

    hypothesis fuzz -n 2 -- tests/fuzz_targets.py
    hypothesis fuzz -n 2 -- tests/fuzz_targets.py -k "v2chain"    # some cells

The file's name is outside pytest's ``test_*.py`` pattern, so the default test run does not
collect it (``test_stateful.py`` runs the same machines under the fixed seed);
``pytest tests/fuzz_targets.py`` replays what the fuzzer saved in ``.hypothesis/``. A
violation is also saved as an operation script (``OVERLAP_SPEC_OUT``, default
``.overlap-spec/``): ``overlap-spec replay FILE`` re-runs it without Hypothesis.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from overlap_spec.harness.drive.script import Op, save_script
from overlap_spec.harness.drive.stateful import get_failure_dir, get_profile, make_machine
from overlap_spec.spec.config import MINIMAL, ModelConfig, enumerate_cells
from overlap_spec.spec.invariants import InvariantViolation


@pytest.fixture(autouse=True)
def _failure_dir() -> None:
    """Overrides the suite's fixture of that name, whose ``tmp_path`` HypoFuzz cannot give (it
    sets fixtures up after its collecting session has ended): a violation's script goes
    where ``overlap-spec check`` puts it."""


def _fuzz_target(config: ModelConfig) -> Any:
    base: Any = make_machine(config, frozenset())

    class Machine(base):  # type: ignore[misc]
        def _apply(self, op: Op) -> None:
            try:
                super()._apply(op)
            except InvariantViolation as violation:
                name = config.name.replace("@", "-")
                path = save_script(self.script, get_failure_dir() / f"fuzz-{name}.json")
                violation.add_note(f"replay: overlap-spec replay {path}")
                raise

    Machine.__name__ = base.__name__
    # HypoFuzz sets its own budget; these settings are for a plain pytest replay of what it
    # found (the database stays the default one, which HypoFuzz requires).
    Machine.TestCase.settings = settings(stateful_step_count=get_profile().step_count,
                                         deadline=None,
                                         suppress_health_check=list(HealthCheck))
    return Machine.TestCase


for _cell in enumerate_cells():
    _name = "Test_" + _cell.name.replace("-", "_")
    globals()[_name] = type(_name, (_fuzz_target(ModelConfig(_cell, MINIMAL)),), {})
