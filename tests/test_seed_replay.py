"""A printed seed replays the same search in any process (the README's promise).

Hypothesis 6.170 draws constants from the project's modules it finds loaded, so before
``harness.drive.stateful.pin_local_constants`` the same seed searched otherwise in a
process that had also imported the differential (or a worker that had run a gpu_impl
task). Two fresh processes, one of them importing the differential first, must now
generate the same operations.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import hypothesis

from overlap_spec.harness.drive.cells import select_configs
from overlap_spec.harness.drive.script import load_script
from overlap_spec.harness.drive.stateful import check_cell, get_profile

PROGRAM = """
import sys
if sys.argv[1] == "differential":
    import overlap_spec.harness.differential.compare  # noqa: F401
from overlap_spec.harness.drive.cells import select_configs
from overlap_spec.harness.drive.stateful import check_cell, get_profile
from overlap_spec.reference.scheduler import Scheduler
calls = []
admit = Scheduler.admit
def record(self, prompt_len, max_new_tokens, prebuilt=False):
    calls.append((prompt_len, max_new_tokens, prebuilt))
    return admit(self, prompt_len, max_new_tokens, prebuilt)
Scheduler.admit = record
check_cell(select_configs("ov-p1-none", "minimal")[0], get_profile("quick"), 20261122,
           shrink=False)
print(calls)
"""


def _admissions(first_import: str) -> str:
    done = subprocess.run([sys.executable, "-c", PROGRAM, first_import], capture_output=True,
                          text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def test_a_seed_searches_the_same_whatever_the_process_imported() -> None:
    plain, with_differential = _admissions("plain"), _admissions("differential")
    assert plain.startswith("[(") and plain == with_differential


def test_a_saved_counterexample_names_its_seed_and_the_hypothesis_that_searched(
        tmp_path: Path) -> None:
    """The saved script carries the run's seed and Hypothesis version: the seed replays
    the same search only under that version (pyproject allows a range)."""
    config = select_configs("ov-p1-none", "minimal")[0]
    result = check_cell(config, get_profile("quick"), 20261122, frozenset({"B1"}),
                        save_dir=tmp_path, shrink=False)
    assert result.script_path is not None, "B1 must trip SL3 in ov-p1-none"
    script = load_script(result.script_path)
    assert (script.seed, script.hypothesis_version) == (20261122, hypothesis.__version__)
    raw = json.loads(Path(result.script_path).read_text())
    assert raw["hypothesis_version"] == hypothesis.__version__
