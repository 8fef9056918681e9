"""The pytest plugin: the spec's checkers as fixtures for any test suite, and the project's
Hypothesis profiles under ``--hypothesis-profile``.

pytest loads it through the ``pytest11`` entry point of the installed package
(``pyproject.toml``), under the plugin name ``overlap_spec`` (``-p no:overlap_spec``
switches it off). It is loaded in every pytest run of an environment that holds the
package, so this module imports nothing beyond pytest: each fixture imports what it needs
when a test uses it (hypothesis, the reference, the trace checker; never torch or z3 here).

Fixtures, each a session-scoped factory (stateless, so a ``@given`` test may use it without
Hypothesis's function-scoped-fixture health check); ``cell`` is a cell name
(``overlap-spec cells``), a :class:`~overlap_spec.spec.config.Cell` or a
:class:`~overlap_spec.spec.config.ModelConfig`, ``preset`` a preset name:

- ``overlap_spec_strategies(cell, preset="minimal", upstream=False)``: the Hypothesis
  strategies the project's state machine draws its operations' arguments from
  (:func:`overlap_spec.harness.drive.generate.get_strategies`);
- ``overlap_spec_checker(cell, preset="minimal")``: a fresh
  :class:`~overlap_spec.harness.drive.checker.InvariantChecker`, the callable a model calls
  at every observation point; it checks every invariant that applies to the cell and raises
  :class:`~overlap_spec.spec.invariants.InvariantViolation` (an ``AssertionError``) naming
  the ID, the request and both values; ``.exercised`` counts what it judged, per ID;
- ``overlap_spec_check_trace(path)``: the trace checker's
  :class:`~overlap_spec.harness.trace.check.TraceVerdict` on an ndjson trace (written by
  ``harness/trace/shim.py`` around a live scheduler, or by ``overlap-spec trace record``).

Profiles. ``dev`` and ``thorough`` are registered with Hypothesis (their budgets are
``PROFILES`` in :mod:`overlap_spec.harness.drive.stateful`) before Hypothesis's own plugin
loads the profile named by ``--hypothesis-profile`` (this module's ``pytest_configure`` runs
first). A name already registered is left alone: a suite's own profile of the same name
wins, and so does Hypothesis's built-in ``ci`` (Hypothesis loads it by itself on CI
machines; an installed plugin must not change another suite's CI runs). A project profile
named on the command line also becomes ``HYPOTHESIS_PROFILE`` for the run, the budget of
the project's own checkers (``get_profile()``), so one option sets both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import pytest

if TYPE_CHECKING:
    from overlap_spec.harness.drive.checker import InvariantChecker
    from overlap_spec.harness.drive.generate import OpStrategies
    from overlap_spec.harness.trace.check import TraceVerdict
    from overlap_spec.spec.config import Cell, ModelConfig

PROFILE_OPTION = "--hypothesis-profile"
PROFILE_VARIABLE = "HYPOTHESIS_PROFILE"


class StrategiesFactory(Protocol):
    def __call__(self, cell: str | Cell | ModelConfig, preset: str = "minimal",
                 upstream: bool = False) -> OpStrategies: ...


class CheckerFactory(Protocol):
    def __call__(self, cell: str | Cell | ModelConfig,
                 preset: str = "minimal") -> InvariantChecker: ...


class TraceCheck(Protocol):
    def __call__(self, trace: str | os.PathLike[str]) -> TraceVerdict: ...


def get_config(cell: str | Cell | ModelConfig, preset: str = "minimal") -> ModelConfig:
    """The configuration a fixture works in: a cell (by name or value) under ``preset``; a
    :class:`ModelConfig` is taken as it is."""
    from overlap_spec.spec.config import PRESETS, ModelConfig, get_cell

    if isinstance(cell, ModelConfig):
        return cell
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return ModelConfig(get_cell(cell) if isinstance(cell, str) else cell, PRESETS[preset])


def register_profiles() -> tuple[str, ...]:
    """Register the project's profiles that no one registered before; return their names.

    Each is Hypothesis's ``default`` profile with the project's budget (examples per test,
    steps per state-machine run), the same on every machine."""
    from hypothesis import settings
    from hypothesis.errors import InvalidArgument

    from overlap_spec.harness.drive.stateful import PROFILES

    added: list[str] = []
    for name, profile in PROFILES.items():
        try:
            settings.get_profile(name)
        except InvalidArgument:
            settings.register_profile(name, settings.get_profile("default"),
                                      max_examples=profile.max_examples,
                                      stateful_step_count=profile.step_count)
            added.append(name)
    return tuple(added)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # tryfirst: Hypothesis's plugin loads the named profile in its own pytest_configure.
    name = config.getoption(PROFILE_OPTION, default=None)
    if not name:
        return  # nothing asks for a profile: Hypothesis is not even imported
    register_profiles()
    from overlap_spec.harness.drive.stateful import PROFILES  # imported by now: no cost

    if name not in PROFILES:
        return
    before = os.environ.get(PROFILE_VARIABLE)
    if before not in (None, name):
        raise pytest.UsageError(f"{PROFILE_OPTION}={name} and {PROFILE_VARIABLE}={before} "
                                "disagree; give one of them")
    os.environ[PROFILE_VARIABLE] = name
    if before is None:  # an in-process run (pytester) must not leave it behind
        config.add_cleanup(_forget_profile_variable)


def _forget_profile_variable() -> None:
    os.environ.pop(PROFILE_VARIABLE, None)


@pytest.fixture(scope="session")
def overlap_spec_strategies() -> StrategiesFactory:
    """``(cell, preset="minimal", upstream=False) -> OpStrategies``: the operation
    arguments' Hypothesis strategies in that cell (``upstream``: the shapes sglang 0.5.23
    can be driven through)."""
    from overlap_spec.harness.drive.generate import get_strategies

    def make(cell: str | Cell | ModelConfig, preset: str = "minimal",
             upstream: bool = False) -> OpStrategies:
        return get_strategies(get_config(cell, preset), upstream)

    return make


@pytest.fixture(scope="session")
def overlap_spec_checker() -> CheckerFactory:
    """``(cell, preset="minimal") -> InvariantChecker``: a fresh observer that checks every
    applicable invariant at each observation it is called with."""
    from overlap_spec.harness.drive.checker import InvariantChecker

    def make(cell: str | Cell | ModelConfig, preset: str = "minimal") -> InvariantChecker:
        return InvariantChecker(get_config(cell, preset))

    return make


@pytest.fixture(scope="session")
def overlap_spec_check_trace() -> TraceCheck:
    """``(path) -> TraceVerdict``: the spec's verdict on a trace file (``.ok``,
    ``.describe()``); malformed input raises ``TraceFormatError`` with the line and field."""
    from overlap_spec.harness.trace.check import check_trace_file

    def check(trace: str | os.PathLike[str]) -> TraceVerdict:
        return check_trace_file(Path(trace))

    return check
