"""HypoFuzz's targets (tests/fuzz_targets.py): one state machine per cell, collected only
when named, and runnable the way HypoFuzz runs them (fixtures set up outside a session)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from overlap_spec.spec.config import enumerate_cells

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ROOT / "tests" / "fuzz_targets.py"

_PROBE = """
from hypofuzz.collection import collect_tests

found = collect_tests([{targets!r}, "-k", "Test_ov_p4_none"])
(target,) = found.fuzz_targets
target._enter_fixtures()
for _ in range(3):
    target.run_one()
assert not target.failed_fatally and not target.has_found_failure
print("fuzzed", target.nodeid)
"""


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """In ``tmp_path``: Hypothesis's database and any saved script stay out of the work tree."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OVERLAP_SPEC_OUT": str(tmp_path / "out"), "PYTHONPATH": path}
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def test_one_fuzz_target_per_cell_and_only_when_named(tmp_path: Path) -> None:
    named = _run(["-m", "pytest", "--collect-only", "-q", str(TARGETS)], tmp_path)
    assert named.returncode == 0, named.stdout[-2000:] + named.stderr[-2000:]
    expected = {f"tests/fuzz_targets.py::Test_{c.name.replace('-', '_')}::runTest"
                for c in enumerate_cells()}
    assert expected <= set(named.stdout.split())
    # The default run leaves it out: pytest's own file patterns, which pyproject keeps.
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    assert "python_files" not in options["ini_options"]
    assert not any(fnmatch(TARGETS.name, p) for p in ("test_*.py", "*_test.py"))


def test_hypofuzz_runs_a_target(tmp_path: Path) -> None:
    pytest.importorskip("hypofuzz", reason="HypoFuzz is the 'fuzz' extra: pip install "
                        "-e '.[fuzz]'")
    done = _run(["-c", _PROBE.format(targets=str(TARGETS))], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "fuzzed tests/fuzz_targets.py::Test_ov_p4_none::runTest" in done.stdout


def test_each_fuzz_target_has_its_own_database_key() -> None:
    """Hypothesis keys a state machine by its class's source, the same for every cell: the
    targets add their cell to the key, so one cell's replay cannot delete a failure another
    cell saved in a shared (or local) example database."""
    from hypothesis.internal.reflection import function_digest

    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import fuzz_targets
    finally:
        sys.path.remove(str(ROOT / "tests"))
    machines = [getattr(fuzz_targets, name).runTest._hypothesis_state_machine_class
                for name in dir(fuzz_targets) if name.startswith("Test_")]
    assert len(machines) == len(enumerate_cells())
    assert len({function_digest(machine) for machine in machines}) == len(machines)
