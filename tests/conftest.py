"""Shared set-up: failing scripts go to a temporary folder, not the work tree; the project's
pytest plugin; under pytest-xdist, a module's shared fixture is built once.

The plugin (``harness/pytest_plugin.py``: fixtures, Hypothesis profiles) reaches this suite
the way it reaches an SGLang suite: through the installed package's ``pytest11`` entry
point, which pytest loads before it imports any conftest. Naming it here as well would
register one module twice under two names, which pytest refuses; so it is named here only
when nothing has imported it by now: installed metadata older than the entry point (a
checkout run with ``PYTHONPATH`` against an older install), ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``,
or ``-p no:overlap_spec``. Either way this suite runs with the plugin, loaded once.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import pytest

PLUGIN = "overlap_spec.harness.pytest_plugin"

pytest_plugins = ["pytester", *([] if PLUGIN in sys.modules else [PLUGIN])]


@pytest.fixture(autouse=True)
def _failure_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERLAP_SPEC_OUT", str(tmp_path / "out"))


# ----------------------------------------------------------------------------- cells
# A test that takes a ``tier_cell`` argument runs in every cell, but only these six in the
# default tier: between them every value of each dimension (overlap, page size, speculative
# mode, CPU mirror, pre-claim). The other 26 are marked slow (``-m slow``). Where the test
# repeats a tier of `check`, `check`, which CI runs, covers all 32 with the same tier at a
# larger budget. .ci/run runs the 26 of the BMC against the reference, the BMC's plain
# unrolling and ALLOC lemma, progress, gpu_impl's port test at both presets and the model
# against the relation (tests/test_model_refines_relation.py).
DEFAULT_TIER_CELLS = frozenset({
    "ov-p1-none", "nov-p4-none", "ov-p1-v2chain-cpu-honest", "nov-p1-v2chain-cpu-honest",
    "ov-p4-v2chain-nocpu-preclaim", "ov-p1-v2tree-cpu-preclaim",
})


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "tier_cell" in metafunc.fixturenames:
        from overlap_spec.spec.config import enumerate_cells

        metafunc.parametrize("tier_cell", [
            pytest.param(cell.name, id=cell.name,
                         marks=() if cell.name in DEFAULT_TIER_CELLS else pytest.mark.slow)
            for cell in enumerate_cells()])


# ----------------------------------------------------------------------------- pytest-xdist
# `pytest -n auto`: each worker builds a module-scoped fixture for itself, so the tests of
# one module spread over N workers would build the mutant matrix (or the vectors) N times.
# The default distribution (`load`) is replaced by one that keeps such a module's tests on
# one worker and spreads every other test one by one. (xdist's own `--dist loadgroup` would
# say the same with marks, but it does not group under pytest 9.2: pytest-xdist issue 1386.)
# A seed is per test and a failure's script goes to the test's own tmp_path (printed with
# the failure), so which worker ran a test changes nothing.


def has_module_fixture(path: Path) -> bool:
    """Whether the test file defines a ``@pytest.fixture(scope="module")``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.fixture" and any(
                k.arg == "scope" and isinstance(k.value, ast.Constant) and k.value.value == "module"
                for k in node.keywords):
            return True
    return False


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # an xdist hook: absent without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "load":
        return None  # an explicit --dist is honoured
    from xdist.scheduler import LoadScopeScheduling

    shared: dict[str, bool] = {}

    class SharedFixtureScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """A module with a module-scoped fixture is one unit of work; any other test is one."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module not in shared:
                shared[module] = has_module_fixture(config.rootpath / module)
            return module if shared[module] else nodeid

    return SharedFixtureScheduling(config, log)
