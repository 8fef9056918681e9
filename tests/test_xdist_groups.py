"""Under pytest-xdist (`pytest -n auto`), this suite's conftest keeps the tests that share a
module-scoped fixture on one worker, so the fixture (the mutant matrix, the vectors) is built
once, while other tests spread one by one."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_SHARED = """
import os
from pathlib import Path

import pytest

@pytest.fixture(scope="module")
def matrix():
    with open(Path(__file__).parent / "builds.txt", "a") as log:
        log.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
    return 1

@pytest.mark.parametrize("bug", range(8))
def test_uses_the_matrix(matrix, bug):
    assert matrix == 1
"""

_SPREAD = """
import os
import time
from pathlib import Path

import pytest

@pytest.mark.parametrize("cell", range(8))
def test_alone(cell):
    with open(Path(__file__).parent / "workers.txt", "a") as log:
        log.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
    time.sleep(0.3)  # long enough that one worker cannot take them all alone
"""


def _run(pytester: pytest.Pytester, **files: str) -> pytest.RunResult:
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(**files)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(pytester.path)
        return pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider")


def test_a_module_fixture_is_built_on_one_worker(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist", reason="pytest-xdist is in the dev extra")
    _run(pytester, test_shared=_SHARED, test_spread=_SPREAD).assert_outcomes(passed=16)
    assert len((pytester.path / "builds.txt").read_text().split()) == 1


def test_tests_without_a_module_fixture_spread_over_the_workers(
        pytester: pytest.Pytester) -> None:
    """Alone (with the shared module beside them, one worker may rightly be busy with it
    for the whole run), the one-by-one tests go to both workers."""
    pytest.importorskip("xdist", reason="pytest-xdist is in the dev extra")
    _run(pytester, test_spread=_SPREAD).assert_outcomes(passed=8)
    assert len(set((pytester.path / "workers.txt").read_text().split())) == 2
