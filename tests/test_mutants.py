"""Every historical bug, switched on alone, is killed by the Hypothesis checker.

A checker that stops catching a bug fails here. The matrix runs once per session
(representative cells, ci budget) and each test reads its part.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overlap_spec.harness.catalogue import BUGS, get_bug
from overlap_spec.harness.cli import main
from overlap_spec.harness.drive.minimize import minimize_script
from overlap_spec.harness.drive.script import Admit, Iterate, Script, load_script, run_script
from overlap_spec.harness.drive.stateful import get_profile
from overlap_spec.harness.mutants.matrix import MutantResult, run_mutants
from overlap_spec.harness.mutants.select import (
    KILLED,
    get_applicable_cells,
    get_representative_cells,
)
from overlap_spec.spec.bugs import BUG_IDS
from overlap_spec.spec.invariants import INVARIANT_IDS
from overlap_spec.spec.state import IterationChoices

SEED = 20261122


# The matrix is about a minute of CPU: its tests are ``slow`` and .ci/run runs them (the
# step of the default tier's long tests). CI's own `./dev check` also runs this very matrix
# (profile ci, this seed, the representative cells) and fails on a survivor. The default
# tier keeps the Hypothesis checker's kills of eight bugs with their replays
# (tests/test_guards.py), of B18 to B20 (tests/test_chunked_prefill.py) and of B1
# (tests/test_seed_replay.py), the other tests here, the exhaustive tier's cheap kills
# (tests/test_exhaust.py, FAST_KILLS but B9 and B16) and the Z3 column's
# (tests/test_proofs_bmc.py, B16 among them).
@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, MutantResult]:
    out = tmp_path_factory.mktemp("mutants")
    return {r.bug.id: r for r in run_mutants(get_profile("ci"), SEED, save_dir=out)}


def test_catalogue_is_complete_and_consistent() -> None:
    assert BUG_IDS == tuple(f"B{i}" for i in range(1, 40))
    # The catalogue (harness) lists exactly the IDs the spec and the implementations take.
    assert tuple(bug.id for bug in BUGS) == BUG_IDS
    for bug in BUGS:
        assert set(bug.invariants) <= set(INVARIANT_IDS), bug.id
        # A kill is a listed invariant or, for a bug that was a crash (B2, B25), exactly
        # that crash: never neither.
        assert bug.invariants or bug.crash is not None, bug.id
        # A radix bug applies in radix cells only, the others in the cells without the
        # cache (harness/mutants/select.py).
        cells = get_applicable_cells(bug)
        assert cells and all(c.radix == bug.radix for c in cells), bug.id
        assert get_representative_cells(bug), bug.id
        for name in bug.representative_cells:
            assert any(c.name == name for c in cells), name
    assert {b.id for b in BUGS if b.radix} == {f"B{i}" for i in range(26, 36)}
    stream = {b.id for b in BUGS if b.stream_level}
    assert {"B5", "B8", "B9", "B13", "B15"} <= stream


@pytest.mark.slow
@pytest.mark.parametrize("bug_id", BUG_IDS)
def test_bug_is_killed_by_an_invariant_it_breaks(bug_id: str,
                                                 matrix: dict[str, MutantResult]) -> None:
    result = matrix[bug_id]
    assert result.verdict == KILLED, [(c.cell, c.verdict, c.detail) for c in result.cells]
    bug = get_bug(bug_id)
    for cell in result.cells:
        if cell.invariant is not None and cell.invariant.startswith("crash:"):  # B25
            assert bug.crash is not None and cell.invariant == bug.crash.label, cell
            assert cell.replay, cell
            outcome = run_script(load_script(Path(cell.replay.split()[-1])), catch_crash=True)
            assert bug.crash.matches(outcome.crashed), outcome.crash
            continue
        assert set(cell.all_invariants) & set(bug.invariants), (
            f"{bug_id} in {cell.cell} tripped {cell.all_invariants}, expected one of "
            f"{bug.invariants}")
        assert cell.ops is not None and cell.requests is not None and cell.replay
        path = Path(cell.replay.split()[-1])
        replayed = run_script(load_script(path))
        assert replayed.violation is not None and cell.invariant in replayed.violation.all_ids


def test_every_radix_invariant_stops_a_radix_bug() -> None:
    """Each RX invariant is among what a radix bug's saved kill trips (issue 42: every
    invariant of the family has a mutant it kills), on the committed corpus's radix scripts
    (tests/data/mutant_scripts): replayed, each fails at a catalogue invariant of its bug,
    and together they trip RX1 to RX7."""
    corpus = Path(__file__).parent / "data" / "mutant_scripts"
    tripped: set[str] = set()
    for path in sorted(corpus.glob("*-radix-*.json")):
        script = load_script(path)
        bug = get_bug(script.faults[0])
        violation = run_script(script).violation
        assert bug.radix and violation is not None, path.name
        assert set(violation.all_ids) & set(bug.invariants), (path.name, violation.all_ids)
        tripped |= set(violation.all_ids)
    rx = {i for i in INVARIANT_IDS if i.startswith("RX")}
    assert rx and rx <= tripped, sorted(rx - tripped)


@pytest.mark.slow
def test_every_radix_bug_is_killed_in_every_radix_cell_it_applies_in(tmp_path: Path) -> None:
    """B26-B35 beyond their representative cells: the Hypothesis column kills each in every
    radix cell where it applies, at the quick budget (about a minute on 2 cores)."""
    radix = {bug.id for bug in BUGS if bug.radix}
    results = run_mutants(get_profile("quick"), SEED, radix, save_dir=tmp_path,
                          all_cells=True, jobs=2)
    for result in results:
        assert result.verdict == KILLED, [(c.cell, c.verdict, c.detail) for c in result.cells]
        assert len(result.cells) == len(get_applicable_cells(result.bug)), result.bug.id
        assert all(set(c.all_invariants) & set(result.bug.invariants) for c in result.cells)


@pytest.mark.slow
def test_b36_is_killed_in_every_cell_it_applies_in(tmp_path: Path) -> None:
    """B36 (a stale prefix offset after a retraction) lies past the exhaustive tier's depth
    in the speculative cells (tests/test_exhaust.py, PAST_SPEC_DEPTH): the Hypothesis
    column kills it by KV14 in every cell, at the quick budget."""
    (result,) = run_mutants(get_profile("quick"), SEED, {"B36"}, save_dir=tmp_path,
                            all_cells=True, jobs=2)
    assert result.verdict == KILLED, [(c.cell, c.verdict, c.detail) for c in result.cells]
    assert len(result.cells) == len(get_applicable_cells(result.bug))
    assert all("KV14" in c.all_invariants for c in result.cells)


@pytest.mark.slow
def test_counterexamples_are_small(matrix: dict[str, MutantResult]) -> None:
    small = 0
    for result in matrix.values():
        rep = result.get_representative()
        assert rep is not None
        small += (rep.requests or 0) <= 2 and (rep.ops or 0) <= 8
    assert small >= 0.9 * len(matrix), f"only {small}/{len(matrix)} are <= 2 requests, 8 ops"


def test_correct_design_passes_the_mutant_witness_scripts() -> None:
    """The B16 finding: 2A of a narrower rung does not cover a wider in-flight verify."""
    ops = [Admit(1, 8), Iterate(IterationChoices(True, 0, (1,), frozenset())),
           Iterate(IterationChoices(False, 0, (4,), frozenset(), False, 3)),
           Iterate(IterationChoices(False, 0, (4,), frozenset(), False, 3)),
           Iterate(IterationChoices(False, 0, (1,), frozenset(), False, 1))]
    cell = "ov-p1-v2chain-cpu-honest"
    assert run_script(Script(cell, "minimal", ops)).violation is None
    broken = run_script(Script(cell, "minimal", ops, ("B16",))).violation
    assert broken is not None and broken.invariant_id == "KV3"
    assert "beyond kv_allocated_len" in str(broken)


def test_minimizer_keeps_the_invariant_and_never_grows() -> None:
    ops = [Admit(3, 5), Admit(2, 4),
           Iterate(IterationChoices(True, 0, (2, 1, 1), frozenset())),
           Iterate(IterationChoices(True, 1, (1, 2, 1), frozenset({1}))),
           Iterate(IterationChoices(True, 0, (1, 1, 1), frozenset()))]
    script = Script("ov-p1-none", "minimal", ops, ("B8",))
    first = run_script(script).violation
    assert first is not None
    small = minimize_script(script, first.invariant_id)
    assert len(small.ops) <= len(script.ops)
    again = run_script(small).violation
    assert again is not None and first.invariant_id in again.all_ids


def test_minimizer_tries_only_real_changes_and_stops_at_a_fixpoint() -> None:
    """Every trial differs from the script it would replace: a candidate equal to its
    operation "still fails" by construction, and counted as progress it kept the passes
    running until the budget was spent (400 replays per kill)."""
    plain = IterationChoices(True, 0, (1,), frozenset(), False, 0, 0)
    script = Script("ov-p1-none", "minimal", [Admit(1, 2), Iterate(plain)], ("B8",))
    trials: list[Script] = []

    def still_fails(trial: Script) -> bool:
        trials.append(trial)
        return trial.ops == script.ops

    assert minimize_script(script, "ST2", still_fails=still_fails).ops == script.ops
    assert trials and all(t.ops != script.ops for t in trials)
    assert len(trials) < 10, len(trials)


def test_mutants_cli_json(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    # The gpu_impl column has its own test (tests/test_gpu_impl.py); here, the CLI's JSON.
    assert main(["mutants", "-q", "--bugs", "B8,B2", "--checkers", "hypothesis,z3",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["version"] == 1 and doc["ok"] is True
    assert set(doc["mutants"]) == {"B2", "B8"}
    entry = doc["mutants"]["B8"]["hypothesis"]
    assert entry["verdict"] == "killed" and entry["invariant"] == "ST2"
    assert isinstance(entry["ops"], int) and isinstance(entry["seconds"], float)
    assert main(["mutants", "--bugs", "B99"]) == 2


def test_a_violation_of_an_unlisted_id_is_not_a_kill(tmp_path: Path) -> None:
    """The README's rule: a kill trips an invariant the catalogue lists for the bug. B8
    trips ST2; against a catalogue entry that lists only KV1 it is "other-id", which
    fails the matrix like a survivor, and says what it tripped."""
    import dataclasses

    from overlap_spec.harness.mutants.matrix import render_mutants, run_mutant_in_cell
    from overlap_spec.harness.mutants.select import OTHER_ID
    from overlap_spec.spec.config import PRESETS, ModelConfig, get_cell

    bug = dataclasses.replace(get_bug("B8"), invariants=("KV1",))
    config = ModelConfig(get_cell("ov-p1-none"), PRESETS["minimal"])
    kill = run_mutant_in_cell(bug, config, get_profile("ci"), SEED, tmp_path)
    assert kill.verdict == OTHER_ID and "ST2" in (kill.detail or "")
    result = MutantResult(bug, "hypothesis", [kill])
    assert result.verdict == OTHER_ID
    assert "killed by another ID" in render_mutants([result])


def test_only_the_expected_crash_kills_a_crash_bug(tmp_path: Path) -> None:
    """B25 is killed by its crash: a ValueError raised in retract_decode with the words of
    ``spec.bugs.LAST_REQUEST_OOM``. The same run against an entry that expects another type,
    another function or other words is no kill (the crash is reported, never a pass)."""
    import dataclasses

    from overlap_spec.harness.crash import Crash
    from overlap_spec.harness.drive.cells import make_preset
    from overlap_spec.harness.mutants.matrix import run_mutant_in_cell
    from overlap_spec.harness.mutants.select import SURVIVED
    from overlap_spec.spec.config import ModelConfig, get_cell

    bug = get_bug("B25")
    assert bug.crash is not None
    config = ModelConfig(get_cell("nov-p1-v2chain-cpu-honest"),
                         make_preset("minimal", dict(bug.sizes)))
    kill = run_mutant_in_cell(bug, config, get_profile("ci"), SEED, tmp_path)
    assert kill.verdict == KILLED and kill.invariant == "crash:ValueError@retract_decode"
    for wrong in (Crash("RuntimeError", "retract_decode", bug.crash.message),
                  Crash("ValueError", "update_running_batch", bug.crash.message),
                  Crash("ValueError", "retract_decode", "out of pages")):
        other = dataclasses.replace(bug, crash=wrong)
        kill = run_mutant_in_cell(other, config, get_profile("ci"), SEED, tmp_path)
        assert kill.verdict == SURVIVED, (wrong, kill)
        assert (kill.detail or "").startswith("crash: ValueError in retract_decode"), kill.detail
        assert wrong.describe() in (kill.detail or "")


def test_a_crash_is_no_kill_of_a_bug_that_breaks_invariants(tmp_path: Path) -> None:
    """The same crash, against an entry that lists invariants instead: not a kill in the
    Hypothesis column (survived, the crash named) nor in gpu_impl's (other-id)."""
    import dataclasses

    from overlap_spec.harness.crash import Crash
    from overlap_spec.harness.drive.cells import make_preset
    from overlap_spec.harness.mutants.matrix import run_gpu_mutant_in_cell, run_mutant_in_cell
    from overlap_spec.harness.mutants.select import OTHER_ID, SURVIVED
    from overlap_spec.spec.config import ModelConfig, get_cell

    bug = dataclasses.replace(get_bug("B25"), invariants=("KV1",), crash=None)
    config = ModelConfig(get_cell("ov-p1-v2chain-cpu-honest"),
                         make_preset("minimal", dict(bug.sizes)))
    kill = run_mutant_in_cell(bug, config, get_profile("ci"), SEED, tmp_path)
    assert kill.verdict == SURVIVED and "crash: ValueError in retract_decode" in (kill.detail or "")
    gpu = run_gpu_mutant_in_cell(bug, config, get_profile("ci"), SEED, tmp_path)
    assert gpu.verdict == OTHER_ID and gpu.invariant == "crash:ValueError@retract_decode"
    right = get_bug("B25").crash
    assert right is not None
    expected = dataclasses.replace(bug, invariants=(), crash=right)
    assert run_gpu_mutant_in_cell(expected, config, get_profile("ci"), SEED,
                                  tmp_path).verdict == KILLED
    for wrong in (Crash("RuntimeError", "retract_decode", right.message),
                  Crash("ValueError", "update_running_batch", right.message),
                  Crash("ValueError", "retract_decode", "out of pages")):
        other = dataclasses.replace(expected, crash=wrong)
        kill = run_gpu_mutant_in_cell(other, config, get_profile("ci"), SEED, tmp_path)
        assert kill.verdict in (OTHER_ID, SURVIVED), (wrong, kill)


def test_a_selection_without_a_bugs_representative_cells_leaves_it_n_a() -> None:
    """`check --cells` or `mutants --cells` that leaves out every cell the catalogue names
    for a bug reports it n/a with the reason, not a survival: B9's row race shows in the
    release's cells in about 2 seeds of 5, so a survival there was luck, a false alarm on
    a clean tree. Nothing runs for it."""
    from overlap_spec.harness.mutants.select import NOT_APPLICABLE
    from overlap_spec.spec.config import get_cell

    cells = (get_cell("ov-p1-v2chain-cpu-honest"),)
    results = run_mutants(get_profile("ci"), SEED, bug_ids={"B9"}, cells=cells,
                          checkers=("hypothesis", "gpu_impl"))
    assert {r.checker for r in results} == {"hypothesis", "gpu_impl"}
    for result in results:
        assert result.verdict == NOT_APPLICABLE and not result.cells, result
        assert "ov-p1-v2chain-cpu-honest-earlyfence" in (result.not_applicable or "")
        assert "overlap-spec mutants --bugs B9" in (result.not_applicable or "")
    # With its representative among the cells, or every applicable cell asked for, it runs.
    with_it = (*cells, get_cell("ov-p1-v2chain-cpu-honest-earlyfence"))
    from overlap_spec.harness.mutants.matrix import get_unselected_representatives
    assert get_unselected_representatives(get_bug("B9"), with_it, False) is None
    assert get_unselected_representatives(get_bug("B9"), cells, True) is None
    assert get_unselected_representatives(get_bug("B9"), None, False) is None
