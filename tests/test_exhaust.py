"""The exhaustive tier (``harness/exhaust``, ``overlap-spec exhaust``).

- Every catalogue bug, switched on alone, is killed by an invariant the catalogue lists for
  it in every cell where it applies, at the cell's default depth (the full matrix is
  ``slow`` and run by ``.ci/run``; one cheap cell per bug runs by default, B9's and B16's
  with the matrix), but for the pairs ``DEEPER_KILLS`` names, searched past those bounds (B17 one
  level deeper with one request, B9 under the release's fence in the pd-decode alphabet).
- The clean reference has no violation at a small depth, with witnesses; a depth too small
  to exercise an invariant reports it vacuous, never passed.
- The counts are deterministic (asserted exactly; timings never are).
- A counterexample replays through ``overlap-spec replay``.
- The search's two exactness claims, on samples: prefixes that reach the same dedup key
  behave the same under the same suffixes, and an iteration run through the oracle is the
  iteration its concrete choices replay; the relevance predicates lose no state.
"""

from __future__ import annotations

import collections
import enum
import json
import pickle
import random
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from overlap_spec.harness.catalogue import BUGS, get_bug
from overlap_spec.harness.cli import main
from overlap_spec.harness.drive.cells import make_preset
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.script import (
    Abort,
    Admit,
    AdmitPrebuilt,
    Iterate,
    Op,
    apply_op,
    load_script,
    run_script,
)
from overlap_spec.harness.exhaust import (
    FULL,
    NON_SPEC_DEPTH,
    PD_DECODE,
    SHARED,
    SHARED_DEPTH,
    SPEC_DEPTH,
)
from overlap_spec.harness.exhaust.alphabet import (
    Alphabet,
    ChoiceOracle,
    OracleReadError,
    get_alphabet,
    get_next_decisions,
)
from overlap_spec.harness.exhaust.search import (
    explore,
    get_state_bytes,
    restore_state,
)
from overlap_spec.harness.exhaust.tier import (
    KILLED,
    CellReport,
    ExhaustTask,
    get_default_depth,
    get_default_scope,
    render_findings,
    run_exhaust_task,
)
from overlap_spec.harness.verdict import Verdict
from overlap_spec.reference.scheduler import Scheduler
from overlap_spec.spec.config import (
    PRESETS,
    Cell,
    ModelConfig,
    enumerate_cells,
    enumerate_radix_cells,
    get_cell,
)
from overlap_spec.spec.invariants import INVARIANTS
from overlap_spec.spec.state import IterationChoices, Observation


# How a pair whose kill lies past the default bounds is searched: depth, requests, the
# alphabet and the sizes in place of the preset's.
@dataclass(frozen=True)
class Search:
    depth: int
    requests: int
    scope: str = FULL
    sizes: tuple[tuple[str, int], ...] = ()


# A bug whose cells are radix cells only (the catalogue's radix mutants, B26 on) is searched
# there, over the shared alphabet (the radix cells' default scope); every other bug in the
# release's and the other eras' cells (enumerate_cells), as before. A bug of the release that
# also applies in radix cells (B1 applies everywhere) is searched in their radix-free twins
# only, where it applies too (test_a_bug_in_a_radix_cell_applies_in_its_twin): its mechanism
# is the twin's, and the shared alphabet, narrowed for the tree, would not reach most of them.
def is_radix_bug(bug_id: str) -> bool:
    """The catalogue's mark (``Bug.radix``), as the mutant matrix selects its cells."""
    return get_bug(bug_id).radix


def get_bug_cells(bug_id: str) -> tuple[Cell, ...]:
    return enumerate_radix_cells() if is_radix_bug(bug_id) else enumerate_cells()


# An abort, the verify launched after it and that verify's late result: five operations
# under overlap, one past the spec cells' depth of 4 (without overlap the result is
# processed in the launching iteration: four, and killed at the default bounds). These
# pairs are enumerated one level deeper with one request (overlap-spec exhaust --depth 5
# --requests 1): 16 cells, about 10 minutes of CPU on 2026-11-27.
# B9 under the release's fence is an FM3 race of a prebuilt request's stash on S with the
# in-flight forward's stash to the row it reuses: a request that stops and runs once more,
# one that finishes by length and sits that decode out (both rows free in one result), and
# a third, prebuilt, that takes the stopped one's row. Six operations and three requests at
# two pool rows (four and seven at the preset's three), past the full alphabet's reach: the
# pd-decode alphabet (prebuilt admissions, EOS positions) enumerates them in 10 to 20 s a
# cell. The early fence's cell keeps B9's FM1 / FM2 within 4 ops of the full alphabet.
DEEPER_KILLS = {(bug.id, cell.name): Search(SPEC_DEPTH + 1, 1)
                for bug in BUGS for cell in enumerate_cells()
                if bug.id == "B17" and bug.applies(cell) and cell.overlap}
B9_SEARCH = Search(6, 3, PD_DECODE, (("max_running_requests", 2),))
DEEPER_KILLS.update({(bug.id, cell.name): B9_SEARCH
                     for bug in BUGS for cell in enumerate_cells()
                     if bug.id == "B9" and bug.applies(cell) and not cell.early_fence
                     and not cell.overshoot})
# B20 under overlap: a running decode, then a chunked prompt that mixes it in as a tail, and
# that mixed step's result one iteration later (admit, iterate, admit, iterate, iterate),
# with no prebuilt arrival (none is drawn with chunking) to start decoding sooner: five
# operations, two requests (about 125 s a chain cell, 36 s a tree, 2026-11-27, two at once).
DEEPER_KILLS.update({(bug.id, cell.name): Search(SPEC_DEPTH + 1, 2)
                     for bug in BUGS for cell in enumerate_cells()
                     if bug.id == "B20" and bug.applies(cell) and cell.overlap})
# Pairs no search kills, each with why and what kills it instead. In the overshoot era (the
# pre-claim cells) a request that finished stays in the running batch, and counts against
# max_running_requests, until the step after its last forward's result: no prebuilt
# request can take its row while that forward still stashes to it, so B9 under the
# release's fence has no row-level race there. The pd-decode search is clean at depth 6
# with 3 requests and 2 rows (asserted below, slow), and at depth 7 with 4 requests and 3
# rows (45,029 states, 118 s in ov-p1-v2chain-cpu-preclaim, 2026-11-27); the Hypothesis
# column does not kill it there either. gpu_impl's race detector, which sees a buffer
# whole as torch.cuda._sanitizer does, flags the unordered write to output_tokens_buf
# (race:FM3 in four operations).
ROW_RACE_FREE = {(bug.id, cell.name): "overshoot era: a finished request holds its slot"
                 for bug in BUGS for cell in enumerate_cells()
                 if bug.id == "B9" and bug.applies(cell) and not cell.early_fence
                 and cell.overshoot}
# B36 (a retracted request re-prefilled from a stale offset) needs two requests decoding,
# a retraction and the re-prefill: five operations without overlap, six with (the prefill's
# result one iteration late; ov-p1-none: 27,912 states, 36 s on 2026-11-29). The overlap
# cells without speculation search one level deeper; in the speculative cells it lies past
# their depth of 4 (clean there at 4: 2,184 to 9,731 states, 4 to 55 s a cell without
# overlap), too deep to enumerate in the matrix, and the Hypothesis column kills it in
# every cell instead (test_mutants.py, slow).
DEEPER_KILLS.update({(bug.id, cell.name): Search(6, 2)
                     for bug in BUGS for cell in enumerate_cells()
                     if bug.id == "B36" and cell.overlap and not cell.is_spec})
PAST_SPEC_DEPTH = {(bug.id, cell.name): "retraction and re-prefill past the spec depth"
                   for bug in BUGS for cell in enumerate_cells()
                   if bug.id == "B36" and cell.is_spec}
# B38 (finished requests counted as running load at admission) needs three requests: the
# finished one, one admitted and one its load leaves out (a prefill that admits nothing is not
# observed, and a continued chunk always has room for its rest: tests/test_admissible_load.py).
# The full alphabet draws two, the pd-decode one admits only prebuilt requests, which
# admission does not count: no search reaches it (overlap-spec exhaust --faults B38 is clean
# in nov-p1-none, 3,269 states). The Hypothesis column kills it (KV13), gpu_impl's
# differential too, and tests/test_admissible_load.py holds the hand-written trigger.
THREE_REQUESTS = {(bug.id, cell.name): "needs three requests; the alphabet draws two"
                  for bug in BUGS for cell in enumerate_cells()
                  if bug.id == "B38" and bug.applies(cell)}
KILL_PAIRS = [(bug.id, cell.name) for bug in BUGS for cell in get_bug_cells(bug.id)
              if bug.applies(cell) and (bug.id, cell.name) not in ROW_RACE_FREE
              and (bug.id, cell.name) not in PAST_SPEC_DEPTH
              and (bug.id, cell.name) not in THREE_REQUESTS]

# One cheap cell per bug (measured on 2 shared cores: B16 about 30 s of CPU, the rest a few
# seconds together); the slow matrix runs every applicable cell.
FAST_KILLS = [
    ("B1", "ov-p1-none"), ("B2", "nov-p1-v2tree-cpu-honest"), ("B3", "ov-p1-v2tree-nocpu-preclaim"),
    ("B4", "ov-p1-v2tree-cpu-preclaim"), ("B5", "ov-p1-v2tree-cpu-honest"),
    ("B6", "ov-p4-v2chain-nocpu-preclaim"), ("B7", "nov-p1-v2chain-cpu-honest"),
    ("B8", "ov-p4-none"), ("B9", "ov-p1-v2chain-cpu-honest-earlyfence"),
    ("B10", "ov-p1-none-trimmed"),
    ("B11", "ov-p1-v2tree-cpu-honest"), ("B12", "nov-p1-v2chain-cpu-honest-rungreserve"),
    ("B13", "ov-p1-v2tree-nocpu-preclaim"), ("B14", "ov-p1-v2tree-nocpu-honest"),
    ("B15", "ov-p1-v2tree-nocpu-honest"), ("B16", "ov-p1-v2chain-cpu-honest"),
    ("B17", "nov-p1-v2chain-cpu-honest"), ("B18", "nov-p1-v2tree-cpu-honest"),
    ("B19", "nov-p1-none"), ("B20", "nov-p1-v2tree-cpu-honest"),
    ("B21", "nov-p4-v2tree-cpu-honest"), ("B22", "nov-p4-v2chain-cpu-honest"),
    ("B23", "nov-p1-v2tree-cpu-honest"), ("B24", "ov-p1-none"),
    ("B25", "ov-p1-v2chain-cpu-honest"),
]


def _get_radix_cost(cell: Cell) -> tuple[bool, bool, int, str]:
    """Cheapest first (bench/results/2026-11-29-exhaust-radix.md): no speculation, no
    overlap, page 1."""
    return cell.is_spec, cell.overlap, cell.page_size, cell.name


# The radix bugs' fast cells: each one's cheapest radix cell where it applies (a few seconds
# of CPU at most), chosen here so that a catalogue entry added for the radix cells joins the
# default tier without an edit.
FAST_KILLS += [(bug.id, min((c for c in enumerate_radix_cells() if bug.applies(c)),
                            key=_get_radix_cost).name)
               for bug in BUGS if is_radix_bug(bug.id)]
FAST_KILLS += [("B36", "nov-p1-none"),
               ("B37", "nov-p1-none"),  # B37: a forced retraction at depth 3, two requests
               ("B39", "nov-p1-none")]  # B39: admit, prefill, pause, iterate (B38: none)


def _config(cell: str) -> ModelConfig:
    return ModelConfig(get_cell(cell), PRESETS["minimal"])



# Fast kills whose counterexample has one request, searched over the one-request alphabet
# (--requests 1): the same depth, about half the states (B16: 4,953 instead of 9,864, 18 s
# instead of 27 s on 2026-11-27). The kill matrix searches them with two.
ONE_REQUEST_FAST_KILLS = {("B16", "ov-p1-v2chain-cpu-honest"), ("B18", "nov-p1-v2tree-cpu-honest")}


def get_default_search(cell: str, requests: int = 2) -> Search:
    """The cell's default bounds: its default alphabet (shared in a radix cell) and depth."""
    scope = get_default_scope(get_cell(cell))
    return Search(get_default_depth(get_cell(cell), scope), requests, scope)


def _assert_killed(bug_id: str, cell: str, out: Path, requests: int = 2) -> None:
    search = DEEPER_KILLS.get((bug_id, cell), get_default_search(cell, requests))
    config = ModelConfig(get_cell(cell), make_preset(
        "minimal", {**dict(get_bug(bug_id).sizes), **dict(search.sizes)}))
    depth, requests = search.depth, search.requests
    report = run_exhaust_task(ExhaustTask(config, depth, frozenset({bug_id}), out, requests,
                                          search.scope))
    assert report.error is None, report.error
    assert report.kill == KILLED, (bug_id, cell, report.kill, report.others)
    stopped = report.stopped
    crash = get_bug(bug_id).crash
    assert stopped is not None
    if crash is not None and stopped.kind == "crash":  # B25: exactly the crash it lists
        assert stopped.expected and stopped.invariant == crash.label
        assert crash.message in stopped.message
    else:
        assert stopped is not None and stopped.kind == "violation"
        assert set(stopped.ids) & set(get_bug(bug_id).invariants), stopped.message
    assert stopped.ops <= depth and stopped.requests <= requests
    assert Path(stopped.script).exists()


# Two fast kills cost most: B16's, about 25 s of CPU in its cheapest cell (4,953 states;
# 80 s on pages of 4), and B9's, about 8 s; the rest take a few seconds each. These two are
# ``slow``: .ci/run runs them with the kill matrix (its step -k "not default_bounds"), which
# also kills each in every cell where it applies. The default tier keeps B16 killed by the
# Z3 column (tests/test_proofs_bmc.py) and its counterexample tripping KV3
# (tests/test_mutants.py::test_correct_design_passes_the_mutant_witness_scripts), and B9's
# stash race caught by every other column (tests/test_fence.py) and by the Z3 column.
SLOW_FAST_KILLS = {("B16", "ov-p1-v2chain-cpu-honest"),
                   ("B9", "ov-p1-v2chain-cpu-honest-earlyfence")}


@pytest.mark.parametrize(("bug_id", "cell"), [
    pytest.param(b, c, id=f"{b}-{c}", marks=pytest.mark.slow if (b, c) in SLOW_FAST_KILLS else ())
    for b, c in FAST_KILLS])
def test_bug_is_killed_fast(bug_id: str, cell: str, tmp_path: Path) -> None:
    _assert_killed(bug_id, cell, tmp_path, 1 if (bug_id, cell) in ONE_REQUEST_FAST_KILLS else 2)


def test_a_crash_other_than_the_expected_one_is_inconclusive_not_a_kill(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """B25's crash, against a catalogue entry that expects another exception type or
    other words: the search still stops at the crash and saves it, but it is no kill
    and the cell is inconclusive (a crash is never a pass)."""
    import dataclasses

    from overlap_spec.harness import catalogue
    from overlap_spec.harness.crash import Crash

    bug = get_bug("B25")
    assert bug.crash is not None
    config = ModelConfig(get_cell("ov-p1-v2chain-cpu-honest"),
                         make_preset("minimal", dict(bug.sizes)))
    for wrong in (Crash("RuntimeError", "retract_decode", bug.crash.message),
                  Crash("ValueError", "update_running_batch", bug.crash.message),
                  Crash("ValueError", "retract_decode", "out of pages")):
        other = dataclasses.replace(bug, crash=wrong)
        monkeypatch.setattr(catalogue, "get_bug", lambda bug_id, other=other: other)
        report = run_exhaust_task(ExhaustTask(config, SPEC_DEPTH, frozenset({"B25"}),
                                              tmp_path))
        assert report.stopped is not None and report.stopped.kind == "crash"
        assert not report.stopped.expected and report.kill != KILLED, report
        assert report.verdict is Verdict.INCONCLUSIVE
        assert Path(report.stopped.script).exists()


def test_the_fast_subset_has_every_bug_in_an_applicable_cell() -> None:
    assert all(get_bug(b).applies(get_cell(c)) for b, c in FAST_KILLS)
    assert [b for b, _ in FAST_KILLS] == [bug.id for bug in BUGS
                                          if bug.id not in {b for b, _ in THREE_REQUESTS}]
    assert not set(FAST_KILLS) & set(DEEPER_KILLS)
    assert ONE_REQUEST_FAST_KILLS <= set(FAST_KILLS) and SLOW_FAST_KILLS <= set(FAST_KILLS)


def test_every_bug_is_in_the_matrix_in_every_cell_where_it_applies() -> None:
    """Only B9 in the six pre-claim cells (ROW_RACE_FREE, with its test below) and B38
    (THREE_REQUESTS: past the alphabet's two requests) are left out;
    the pairs past the default bounds are B17 under overlap (one level deeper, one
    request), B20 under overlap (one level deeper, two requests) and B9 under the
    release's fence (the pd-decode alphabet)."""
    spec_overlap = [c for c in enumerate_cells() if c.is_spec and c.overlap]
    assert sorted(ROW_RACE_FREE) == sorted(("B9", c.name) for c in spec_overlap
                                           if c.preclaim and not c.early_fence)
    assert len(ROW_RACE_FREE) == 6
    assert sorted(PAST_SPEC_DEPTH) == sorted(("B36", c.name) for c in enumerate_cells()
                                             if c.is_spec)
    assert sorted([*KILL_PAIRS, *ROW_RACE_FREE, *PAST_SPEC_DEPTH, *THREE_REQUESTS]) == sorted(
        (bug.id, cell.name) for bug in BUGS for cell in get_bug_cells(bug.id)
        if bug.applies(cell))
    radix = {cell.name for cell in enumerate_radix_cells()}
    assert all((cell in radix) == is_radix_bug(bug_id) for bug_id, cell in KILL_PAIRS)
    assert not any(cell in radix for _, cell in DEEPER_KILLS)  # radix pairs: default bounds
    assert sorted(DEEPER_KILLS) == sorted(
        [("B17", c.name) for c in spec_overlap]
        + [("B20", c.name) for c in spec_overlap if c.mixes_spec_tails]
        + [("B9", c.name) for c in spec_overlap if not c.early_fence and not c.overshoot]
        + [("B36", c.name) for c in enumerate_cells() if c.overlap and not c.is_spec])
    assert {pair for pair, search in DEEPER_KILLS.items() if search.scope == PD_DECODE} == {
        pair for pair in DEEPER_KILLS if pair[0] == "B9"}


@pytest.mark.slow
def test_b9_under_the_releases_fence_in_the_pd_decode_alphabet(tmp_path: Path) -> None:
    """One pair of the matrix's pd-decode kills (the cheapest cell), through the command
    line; the others run with the matrix (which calls the task directly). Slow (about 13 s
    of CPU), run by .ci/run with the matrix; the default tier kills B9 in the early fence's
    cell (FAST_KILLS) and keeps the pd-decode alphabet's own test below."""
    pair = ("B9", "ov-p1-v2tree-nocpu-honest")
    search = DEEPER_KILLS[pair]
    assert search == B9_SEARCH and search.scope == PD_DECODE
    report_path = tmp_path / "report.json"
    code = main(["exhaust", "--alphabet", "pd-decode", "--cells", pair[1], "--faults", "B9",
                 "--depth", "6", "--requests", "3", "--sizes", "max_running_requests=2",
                 "-j", "1", "-q", "--out", str(tmp_path), "--json", str(report_path)])
    assert code == 1
    cell = json.loads(report_path.read_text())["cells"][
        f"{pair[1]}@minimal[max_running_requests=2]"]
    assert cell["kill"] == KILLED and cell["stopped"]["invariant"] == "FM3"
    assert cell["alphabet"].startswith("pd-decode alphabet: up to 3 requests;")
    assert (cell["stopped"]["ops"], cell["stopped"]["requests"]) == (6, 3)
    # Its own file name: a full-alphabet run into the same folder does not overwrite it.
    script = Path(cell["stopped"]["script"])
    assert script.name == f"{pair[1]}-minimal[max_running_requests=2]-pd-decode-B9.json"
    assert cell["stopped"]["replay"] == f"overlap-spec replay {script}"
    assert load_script(script).faults == ("B9",)


@pytest.mark.slow
def test_the_full_alphabet_does_not_kill_b9_under_the_releases_fence(tmp_path: Path) -> None:
    """Why the pd-decode alphabet exists: at its default bounds the full one is clean."""
    report = run_exhaust_task(ExhaustTask(_config("ov-p1-v2tree-nocpu-honest"), SPEC_DEPTH,
                                          frozenset({"B9"}), tmp_path))
    assert report.complete and report.kill != KILLED and report.states > 1000


@pytest.mark.slow
@pytest.mark.parametrize("cell", sorted(c for _, c in ROW_RACE_FREE))
def test_b9_with_the_releases_fence_has_no_row_race_in_the_overshoot_era(
        cell: str, tmp_path: Path) -> None:
    """The search that kills B9 in the release's cells finds nothing here: complete, clean.
    Should a change make the race reachable, this fails and the pair joins the matrix."""
    config = ModelConfig(get_cell(cell), make_preset("minimal", dict(B9_SEARCH.sizes)))
    report = run_exhaust_task(ExhaustTask(config, B9_SEARCH.depth, frozenset({"B9"}),
                                          tmp_path, B9_SEARCH.requests, B9_SEARCH.scope))
    assert report.error is None and report.complete, report.error
    assert report.kill != KILLED and report.stopped is None and not report.others
    assert report.states > 1000  # it searched: 7,074 states in ov-p1-v2chain-cpu-preclaim
    assert report.exercised.get("FM3", 0) > 0  # and judged the stash pairs it claims race-free


def test_the_pd_decode_alphabet_is_prebuilt_admissions_and_eos_positions() -> None:
    config = _config("ov-p4-v2chain-cpu-honest")
    alphabet = get_alphabet(config, 3, PD_DECODE)
    assert alphabet.admissions == (AdmitPrebuilt(1, 2), AdmitPrebuilt(1, 8),
                                   AdmitPrebuilt(3, 8))
    assert alphabet.domains["eos_position"] == (None, 0, 1, 2)
    assert all(len(values) == 1 for name, values in alphabet.domains.items()
               if name != "eos_position")
    assert alphabet.describe().startswith("pd-decode alphabet: up to 3 requests;")
    with pytest.raises(ValueError, match="outside 1..3"):
        get_alphabet(config, 4, PD_DECODE)
    with pytest.raises(ValueError, match="not one of"):
        get_alphabet(config, 1, "pd")


def test_one_request_narrows_the_alphabet_and_the_search() -> None:
    """--requests 1: one admission per sequence, the EOS position only row 0, and fewer
    states at the same depth (counts, not times)."""
    config = _config("ov-p1-v2tree-cpu-honest")
    one, two = get_alphabet(config, 1), get_alphabet(config)
    assert (one.max_requests, two.max_requests) == (1, 2)
    assert one.domains["eos_position"] == (None, 0)
    assert one.describe().startswith("up to 1 request;")
    narrow = explore(config, 3, frozenset(), alphabet=one)
    wide = explore(config, 3, frozenset(), alphabet=two)
    assert narrow.complete and wide.complete and narrow.states < wide.states
    with pytest.raises(ValueError, match="outside 1..2"):
        get_alphabet(config, 3)


# B18's counterexample is one request of three chunks; over the two-request alphabet the
# spec overlap cells took 60 to 150 s each (29 cells: 672 s with 2 workers, 2026-11-27), so
# the matrix searches it with one, as the fast subset does B16.
ONE_REQUEST_BUGS = {"B18"}


@pytest.mark.slow
@pytest.mark.parametrize(("bug_id", "cell"), KILL_PAIRS, ids=[f"{b}-{c}" for b, c in KILL_PAIRS])
def test_every_bug_is_killed_in_every_applicable_cell(bug_id: str, cell: str,
                                                      tmp_path: Path) -> None:
    _assert_killed(bug_id, cell, tmp_path, 1 if bug_id in ONE_REQUEST_BUGS else 2)


def test_default_depths() -> None:
    for cell in enumerate_cells():
        assert get_default_depth(cell) == (SPEC_DEPTH if cell.is_spec else NON_SPEC_DEPTH)


# -- the clean reference -----------------------------------------------------------------
# A sample test's costliest cell (about 6 s of CPU each on 2 busy cores) is ``slow``: .ci/run
# runs it with the kill matrix (its step -k "not default_bounds"). Each such test keeps a
# speculative cell and a non-speculative one in the default tier, but the pinned counts,
# which keep the non-speculative one (the same determinism claim).
SAMPLE_SLOW = pytest.mark.slow

@pytest.mark.parametrize("cell", ["ov-p1-none", "nov-p4-none",
                                  pytest.param("ov-p1-v2chain-cpu-preclaim", marks=SAMPLE_SLOW),
                                  "nov-p1-v2tree-cpu-honest"])
def test_clean_reference_has_no_violation_and_has_witnesses(cell: str) -> None:
    result = explore(_config(cell), 3)
    assert result.complete and result.stopped is None and not result.findings
    assert [level.depth for level in result.levels] == [1, 2, 3]
    assert all(level.transitions and level.new_states for level in result.levels)
    applicable = [inv.id for inv in INVARIANTS if inv.applies(get_cell(cell))]
    witnessed = [i for i in applicable if result.exercised[i]]
    assert len(witnessed) >= len(applicable) // 2, witnessed
    assert result.observations > result.transitions


def test_a_depth_too_small_leaves_n_a_with_its_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Below the default bounds an unreached invariant says what the bounds reach: n/a with
    the reason, never vacuous (which would fail a clean tree); the cell passes on what it
    reached and says how many are n/a."""
    report = run_exhaust_task(ExhaustTask(_config("ov-p1-none"), 1, frozenset(), tmp_path))
    assert report.complete and not report.default_bounds
    assert report.not_applicable and not report.vacuous
    assert report.verdict is Verdict.PASS
    code = main(["exhaust", "--cells", "ov-p1-none", "--depth", "1", "-j", "1",
                 "--out", str(tmp_path), "--witnesses"])
    assert code == 0
    out = capsys.readouterr().out
    assert (f"[n/a] ov-p1-none@minimal: {', '.join(report.not_applicable)}: no sequence of "
            "up to 1 operations over this alphabet exercises it") in out
    assert f"pass (n/a {len(report.not_applicable)})" in out
    assert f"{len(report.not_applicable)} invariant x cell n/a (unreached within" in out
    assert f"{report.not_applicable[0]} 0" in out.split("witnesses:")[1]


def test_an_unreached_invariant_at_the_default_bounds_is_vacuous() -> None:
    """At the default bounds every applicable invariant used to have a witness: one that
    no longer has one fails the run (vacuous), whatever else passed."""
    config = _config("ov-p1-none")
    applicable = tuple(inv.id for inv in INVARIANTS if inv.applies(config.cell))
    report = CellReport(config.name, 5, (), "full", applicable, complete=True,
                        exercised={i: 1 for i in applicable[1:]})
    assert report.default_bounds and report.vacuous == applicable[:1]
    assert report.verdict is Verdict.VACUOUS and not report.not_applicable
    assert "[vacuous] ov-p1-none@minimal: no witness for" in render_findings([report])
    report.default_bounds = False
    assert report.verdict is Verdict.PASS and report.not_applicable == applicable[:1]
    fewer = run_exhaust_task(ExhaustTask(config, 5, frozenset(), Path("."), max_requests=1))
    assert not fewer.default_bounds  # fewer requests than the default: not its superset


# -- deterministic counts -------------------------------------------------------------------
EXPECTED_COUNTS = {
    # cell, depth: (states, transitions, observations, per-level new states)
    # Since admission is the release's, the new-token ratio is state and a forced retraction
    # of a batch of one re-estimates it (before: 118, 434 and 512 states). The non-spec
    # alphabet's longest prompt (RP8's witness) raised ov-p1-none's from 164.
    # Issue 43's pause_retract and continue (a paused state, a retract-all) and the held
    # slots' KV contents in the key (KV14 reads them) raised them from 236 / 912 / 1144.
    ("ov-p1-none", 3): (279, 390, 1024, (5, 34, 239)),
    # The release's reserve does not move with the rung, so a rung choice leaves the state
    # as it was; the rung reserve proposal's does (the counts of the pre-proposal model).
    ("ov-p1-v2chain-cpu-honest", 3): (1000, 1650, 13280, (4, 43, 952)),
    ("ov-p1-v2chain-cpu-honest-rungreserve", 3): (1216, 1650, 13280, (4, 43, 1168)),
}
# The witnesses counted over the same runs, all invariants together (issue 43's KV13,
# KV14, RP10 and the pause operations: from 10401, 157437, 158037).
EXPECTED_WITNESSES = {("ov-p1-none", 3): 10886, ("ov-p1-v2chain-cpu-honest", 3): 159628,
                      ("ov-p1-v2chain-cpu-honest-rungreserve", 3): 160228}


@pytest.mark.parametrize(("cell", "depth"), [
    pytest.param(cell, depth, marks=SAMPLE_SLOW if cell != "ov-p1-none" else ())
    for cell, depth in EXPECTED_COUNTS])
def test_counts_are_deterministic(cell: str, depth: int) -> None:
    """One run against the pinned counts: a run that differed from the pin in any process
    (this one, an xdist worker, CI's) fails, which is the determinism claimed."""
    result = explore(_config(cell), depth)
    counts = (result.states, result.transitions, result.observations,
              tuple(level.new_states for level in result.levels))
    assert counts == EXPECTED_COUNTS[(cell, depth)]
    assert sum(result.exercised.values()) == EXPECTED_WITNESSES[(cell, depth)]


# -- counterexamples ---------------------------------------------------------------------------
def test_a_counterexample_replays_through_the_cli(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    report_path = tmp_path / "report.json"
    code = main(["exhaust", "--cells", "ov-p1-none-trimmed", "--faults", "B10", "-j", "1",
                 "--out", str(tmp_path), "--json", str(report_path)])
    out = capsys.readouterr().out
    assert code == 1
    document = json.loads(report_path.read_text())
    cell = document["cells"]["ov-p1-none-trimmed@minimal"]
    assert cell["kill"] == KILLED and cell["stopped"]["invariant"] in get_bug("B10").invariants
    replay = cell["stopped"]["replay"]
    assert f"replay: {replay}" in out
    assert Path(cell["stopped"]["trace"]).exists()
    assert cell["stopped"]["trace_status"] == "violation"
    script = load_script(Path(cell["stopped"]["script"]))
    assert script.faults == ("B10",) and len(script.ops) == cell["stopped"]["ops"]
    assert main(replay.split()[1:]) == 1
    replayed = capsys.readouterr().out
    assert cell["stopped"]["message"] in replayed


def test_a_crash_is_a_failure_with_a_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    def broken_abort(self: Scheduler, rid: object) -> None:
        raise RuntimeError("abort is broken")

    monkeypatch.setattr(Scheduler, "abort", broken_abort)
    report = run_exhaust_task(ExhaustTask(_config("nov-p1-none"), 3, frozenset(), tmp_path))
    assert report.error is None, report.error  # the saved script crashed the same on replay
    assert report.stopped is not None and report.stopped.kind == "crash"
    assert report.stopped.ops == 2 and "abort is broken" in report.stopped.message
    assert report.verdict is Verdict.INCONCLUSIVE and report.verdict.fails_run
    assert main(["replay", report.stopped.script]) == 1
    assert "the model crashed: RuntimeError: abort is broken" in capsys.readouterr().out


# -- exactness of the search, on samples ------------------------------------------------------
class Recorder(InvariantChecker):
    """Checks like the tier and keeps every observation, the op index set to 0."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.seen: list[Observation] = []

    def __call__(self, obs: Observation) -> None:
        from dataclasses import replace

        self.seen.append(replace(obs, step_index=0))
        super().__call__(obs)


def get_value(state: bytes) -> object:
    """A state's value, blind to which equal immutable values are one object: pickle bytes
    are not (a string shared after a restore is written once, two equal strings of a fresh
    run twice), so states are compared through this. Mutable objects reached twice are
    named by the order they were first reached, so shared structure still counts."""
    order: dict[int, int] = {}

    def walk(obj: object) -> object:
        if isinstance(obj, str | int | float | bool | bytes | type(None) | enum.Enum):
            return obj
        if isinstance(obj, tuple | frozenset):
            items = sorted(obj, key=repr) if isinstance(obj, frozenset) else obj
            return (type(obj).__name__, tuple(walk(x) for x in items))
        if id(obj) in order:
            return ("ref", order[id(obj)])
        order[id(obj)] = len(order)
        if isinstance(obj, list | collections.deque):
            return (type(obj).__name__, tuple(walk(x) for x in obj))
        if isinstance(obj, set):
            return ("set", tuple(sorted(walk(x) for x in obj)))  # ints only in the model
        if isinstance(obj, dict):
            return ("dict", tuple((walk(k), walk(v)) for k, v in obj.items()))
        if hasattr(obj, "__dict__"):
            return (type(obj).__name__, tuple((k, walk(v)) for k, v in vars(obj).items()))
        raise TypeError(f"no value for {type(obj).__name__}")

    return walk(pickle.loads(state))


def _run_to_bytes(config: ModelConfig, ops: list[Op]) -> tuple[list[Observation], bytes]:
    """The observations (op index set to 0) and the canonical state bytes."""
    recorder = Recorder(config)
    model = Scheduler(config, frozenset(), recorder)
    admitted: list[int] = []
    for index, op in enumerate(ops):
        model.set_step_index(index)
        apply_op(model, op, admitted)
    return recorder.seen, get_state_bytes(model, admitted)


def _run_from_scratch(config: ModelConfig, ops: list[Op]) -> tuple[list[Observation], object]:
    """The observations (op index set to 0) and the value of the canonical state."""
    seen, state = _run_to_bytes(config, ops)
    return seen, get_value(state)


def _default_alphabet(config: ModelConfig) -> Alphabet:
    """The cell's default alphabet: the shared one in a radix cell, else the full one."""
    return get_alphabet(config, scope=get_default_scope(config.cell))


def _random_suffix(config: ModelConfig, rng: random.Random, admitted: int,
                   length: int) -> list[Op]:
    """Ops of the cell's alphabet, drawn at random (iterations with concrete choices)."""
    alphabet = _default_alphabet(config)
    domains = alphabet.domains
    ops: list[Op] = []
    for _ in range(length):
        kinds = ["iterate", "iterate"] + (["abort"] if admitted else []) + (
            ["admit"] if admitted < alphabet.max_requests else [])
        kind = rng.choice(kinds)
        if kind == "admit":
            ops.append(rng.choice(alphabet.admissions))
            admitted += 1
        elif kind == "abort":
            ops.append(Abort(rng.randrange(admitted)))
        else:
            eos = rng.choice(domains["eos_position"])
            ops.append(Iterate(IterationChoices(
                allow_prefill=bool(rng.choice(domains["allow_prefill"])),
                retract=int(rng.choice(domains["retract"])),
                accept_lens=(int(rng.choice(domains["accept_len"])),) * alphabet.rows,
                eos_positions=frozenset() if eos is None else frozenset({int(eos)}),
                disable_overlap=bool(rng.choice(domains["disable_overlap"])),
                spec_steps=int(rng.choice(domains["spec_steps"])))))
    return ops


def _count_admissions(ops: tuple[Op, ...] | list[Op]) -> int:
    return sum(isinstance(op, Admit | AdmitPrebuilt) for op in ops)


# A radix cell's sample runs one level deeper: its narrow alphabet merges too few prefixes
# at 3 (the tree, its locks and its LRU clock are in the state).
@pytest.mark.parametrize("cell", ["ov-p1-none",
                                  pytest.param("ov-p1-v2chain-cpu-honest", marks=SAMPLE_SLOW),
                                  "nov-p4-v2chain-cpu-preclaim",
                                  "ov-p4-v2chain-cpu-honest-radix"])
def test_prefixes_with_the_same_key_behave_the_same(cell: str) -> None:
    config = _config(cell)
    result = explore(config, 4 if config.cell.radix else 3, keep_paths=True,
                     alphabet=_default_alphabet(config))
    rng = random.Random(7)
    distinct = [(a, b) for a, b in result.merges if a != b]
    assert len(distinct) >= 20, "too few merged prefixes to sample"
    for first, second in rng.sample(distinct, 20):
        assert _count_admissions(first) == _count_admissions(second)
        suffix = _random_suffix(config, rng, _count_admissions(first), 3)
        seen_first, state_first = _run_from_scratch(config, [*first, *suffix])
        seen_second, state_second = _run_from_scratch(config, [*second, *suffix])
        _, at_first = _run_from_scratch(config, list(first))
        _, at_second = _run_from_scratch(config, list(second))
        assert at_first == at_second  # the same state, from scratch
        prefix_first = len(_run_from_scratch(config, list(first))[0])
        prefix_second = len(_run_from_scratch(config, list(second))[0])
        assert seen_first[prefix_first:] == seen_second[prefix_second:], (first, second, suffix)
        assert state_first == state_second


# No radix cell: the shared alphabet keeps one value of allow_prefill and disable_overlap,
# and the model reads retract only where its predicate holds, so there it prunes nothing.
@pytest.mark.parametrize("cell", ["ov-p1-none",
                                  pytest.param("ov-p1-v2tree-nocpu-preclaim", marks=SAMPLE_SLOW),
                                  "nov-p1-v2chain-cpu-honest"])
def test_relevance_predicates_lose_no_state(cell: str) -> None:
    config = _config(cell)
    peeked = explore(config, 3, keep_paths=True)
    full = explore(config, 3, keep_paths=True, peek=False)
    assert set(peeked.paths) == set(full.paths)
    assert full.transitions > peeked.transitions
    assert peeked.complete and full.complete


@pytest.mark.parametrize("cell", ["ov-p4-none",
                                  pytest.param("ov-p1-v2chain-cpu-honest", marks=SAMPLE_SLOW),
                                  "ov-p1-v2tree-nocpu-preclaim", "ov-p4-v2chain-cpu-honest-radix"])
def test_an_oracle_iteration_is_its_concrete_choices(cell: str) -> None:
    """From states two operations reach (a sample of 12; three in a radix cell), every
    distinguishable iteration: the oracle's run and the run of the op it reports give the
    same observations and the same state."""
    config = _config(cell)
    alphabet = _default_alphabet(config)
    result = explore(config, 3 if config.cell.radix else 2, keep_paths=True, alphabet=alphabet)
    paths = list(result.paths.values())
    sample = random.Random(3).sample(paths, min(12, len(paths)))
    leaves = 0
    for path in sample:
        seen_before, state = _run_to_bytes(config, list(path))
        decisions: list[int] | None = []
        while decisions is not None:
            recorder = Recorder(config)
            model, admitted = restore_state(state, recorder)
            oracle = ChoiceOracle(alphabet, decisions)
            oracle.attach(model)
            model.run_iteration(oracle.as_choices())
            through_oracle = (recorder.seen, get_value(get_state_bytes(model, admitted)))
            concrete = Iterate(oracle.get_choices())
            seen_after, state_after = _run_from_scratch(config, [*path, concrete])
            assert through_oracle == (seen_after[len(seen_before):], state_after), concrete
            decisions = get_next_decisions(oracle.taken)
            leaves += 1
    assert leaves > len(sample)


@pytest.mark.parametrize("cell", ["ov-p1-v2chain-cpu-honest", "ov-p1-v2tree-cpu-honest"])
def test_spec_steps_matter_only_through_the_shape(cell: str) -> None:
    """Rung values with the same shape run alike (the oracle offers one value per shape)."""
    config = _config(cell)
    prefix: list[Op] = [AdmitPrebuilt(1, 8), Iterate(IterationChoices(accept_lens=(4,)))]
    values = range(config.preset.chain_steps + 1)
    pairs = [(a, b) for a in values for b in values
             if a < b and config.get_shape(a) == config.get_shape(b)]
    assert pairs
    for a, b in pairs:
        runs = [_run_from_scratch(config, [*prefix, Iterate(IterationChoices(
            accept_lens=(2,), spec_steps=steps))]) for steps in (a, b)]
        assert runs[0] == runs[1], (a, b)


def test_the_oracle_refuses_a_read_it_does_not_answer() -> None:
    oracle = ChoiceOracle(get_alphabet(_config("ov-p1-none")), [])
    with pytest.raises(OracleReadError, match="IterationChoices.bogus"):
        oracle.bogus  # noqa: B018


def test_state_bytes_leave_the_observer_out() -> None:
    config = _config("ov-p1-none")
    checker = InvariantChecker(config)
    model = Scheduler(config, frozenset(), checker)
    state = get_state_bytes(model, [])
    assert model.refinement.observer is checker
    restored, admitted = pickle.loads(state)
    assert restored.refinement.observer is None and admitted == []


# -- the clean tree at the default bounds (slow; .ci/run runs the non-speculative cells) ----
@pytest.mark.slow
@pytest.mark.parametrize("cell", [c.name for c in enumerate_cells()])
def test_the_clean_tree_passes_at_the_default_bounds(cell: str, tmp_path: Path) -> None:
    """Every applicable invariant witnessed, no finding: what `overlap-spec exhaust` says
    of a clean tree at its defaults (RP8 in the non-speculative cells needs the alphabet's
    longest prompt, refused or capped to 0 new tokens)."""
    config = _config(cell)
    report = run_exhaust_task(ExhaustTask(config, get_default_depth(config.cell), frozenset(),
                                          tmp_path))
    assert report.default_bounds and report.complete
    assert report.verdict is Verdict.PASS, (report.vacuous, report.stopped, report.others)


# -- the radix cells: the shared alphabet --------------------------------------------------
RADIX_CELLS = [cell.name for cell in enumerate_radix_cells()]
RX_IDS = [inv.id for inv in INVARIANTS if inv.id.startswith("RX")]


def test_a_bug_in_a_radix_cell_applies_in_its_twin() -> None:
    """Why the matrix searches the release's bugs (B1-B25) in the release cells only: each
    one that applies in a radix cell applies in its twin without the tree, where the matrix
    kills it (the mechanism is the twin's); the radix bugs run in the radix cells."""
    for bug in BUGS:
        if is_radix_bug(bug.id):
            continue
        for cell in enumerate_radix_cells():
            if bug.applies(cell):
                twin = get_cell(cell.name.removesuffix("-radix"))
                assert not twin.radix and bug.applies(twin), (bug.id, cell.name)


def test_the_shared_alphabet() -> None:
    """Prompts of one family, a page and one token long (two under EAGLE), so a second
    request shares the first's page of key; the narrow iteration fields; radix cells only."""
    prompts = {"nov-p1-none-radix": 2, "ov-p1-v2chain-cpu-honest-radix": 3,
               "ov-p4-none-radix": 5, "nov-p4-v2tree-cpu-honest-radix": 6}
    for cell, prompt in prompts.items():
        config = _config(cell)
        alphabet = get_alphabet(config, scope=SHARED)
        assert alphabet.admissions[:2] == (Admit(prompt, 2, family=0), Admit(prompt, 8, family=0))
        # Without speculation the longest prompt too (refused or capped: RP8's witness).
        assert alphabet.admissions[2:] == (() if config.cell.is_spec else (Admit(23, 2, family=0),))
        assert alphabet.domains["retract"] == (0, 1)
        assert alphabet.domains["eos_position"] == (None, 0, 1)
        assert alphabet.domains["accept_len"] == tuple(dict.fromkeys((1, config.max_accept_len)))
        assert all(len(alphabet.domains[name]) == 1 for name in
                   ("allow_prefill", "disable_overlap", "spec_steps"))
        assert alphabet.describe().startswith("shared alphabet: up to 2 requests; "
                                              f"admit({prompt},2,family=0)")
        assert get_default_scope(config.cell) == SHARED
        assert get_default_depth(config.cell) == SHARED_DEPTH
    with pytest.raises(ValueError, match="for radix cells"):
        get_alphabet(_config("ov-p1-none"), scope=SHARED)
    with pytest.raises(ValueError, match="outside 1..2"):
        get_alphabet(_config("ov-p1-none-radix"), 3, SHARED)


def _first_choices(config: ModelConfig) -> IterationChoices:
    """The iteration whose every field takes its domain's first value: the leaf the oracle
    reaches with every decision 0, so the search runs it from every state."""
    alphabet = get_alphabet(config, scope=SHARED)
    first = {name: values[0] for name, values in alphabet.domains.items()}
    choices = IterationChoices(accept_lens=(int(first["accept_len"]),) * alphabet.rows)
    assert (choices.allow_prefill, choices.retract, choices.disable_overlap,
            choices.spec_steps, choices.eos_positions) == (
        first["allow_prefill"], first["retract"], first["disable_overlap"],
        first["spec_steps"], frozenset())
    return choices


def _run_ops(config: ModelConfig, ops: list[Op]) -> tuple[list[Observation], list[int]]:
    seen: list[Observation] = []
    checker = InvariantChecker(config)

    def observe(obs: Observation) -> None:
        checker(obs)
        seen.append(obs)

    model = Scheduler(config, frozenset(), observe)
    admitted: list[int] = []
    for index, op in enumerate(ops):
        model.set_step_index(index)
        apply_op(model, op, admitted)
    return seen, admitted


@pytest.mark.parametrize("cell", RADIX_CELLS)
def test_the_shortest_sharing_scenarios_are_within_the_shared_bounds(cell: str) -> None:
    """docs/upstream-radix-sharing.md section 5, step 5, over the shared alphabet's own
    operations, each short of the default depth (so the search also runs an operation past
    it): the dedup (A and B prefilled together; the second checkpoint finds A's page and
    takes it: one node locked by both, the same slots in both rows) and the match (B
    admitted after A's prefill result: its admission matches a whole page)."""
    config = _config(cell)
    alphabet = get_alphabet(config, scope=SHARED)
    p, late = config.page_size, int(config.cell.overlap)  # a prefill's result one step later
    step = Iterate(_first_choices(config))
    # The longer one asks the most: with another waiting or running, a page-4 spec pool
    # admits the shorter one only.
    short, long = alphabet.admissions[:2]
    dedup: list[Op] = [short, short, step, *[step] * late]
    match: list[Op] = [long, step, *[step] * late, short, step]
    assert max(len(dedup), len(match)) < SHARED_DEPTH
    seen, (a, b) = _run_ops(config, dedup)
    first, second = seen[-1].get_request(a), seen[-1].get_request(b)
    assert first.lock_node == second.lock_node is not None
    assert first.cache_protected_len == second.cache_protected_len >= p
    assert first.row_slots[:p] == second.row_slots[:p]
    assert seen[-1].tree is not None
    assert max(n.lock_ref for n in seen[-1].tree.nodes) == 2
    seen, (a, b) = _run_ops(config, match)
    admission = next(o.admission for o in seen if o.admission is not None
                     and o.admission.waiting and o.admission.waiting[0][0] == b)
    assert admission.prefixes == (p,)
    assert seen[-1].get_request(b).row_slots[:p] == seen[-1].get_request(a).row_slots[:p]


# One cell per kind (no speculation, chain, tree; overlap or not; pages of 1 and 4) in the
# default tier, the rest slow: under a second of CPU a cell.
RX_SAMPLE = {"nov-p1-none-radix", "ov-p4-none-radix", "ov-p1-v2chain-cpu-honest-radix",
             "nov-p4-v2tree-cpu-honest-radix"}


@pytest.mark.parametrize("cell", [pytest.param(c, marks=() if c in RX_SAMPLE else SAMPLE_SLOW)
                                  for c in RADIX_CELLS])
def test_every_rx_invariant_is_witnessed_within_the_dedup_depth(cell: str) -> None:
    """Every radix cell, four operations over the shared alphabet (the dedup's depth): clean,
    and every RX invariant exercised (a few hundred states a cell; the default bounds below
    witness every applicable invariant)."""
    config = _config(cell)
    result = explore(config, 4, alphabet=get_alphabet(config, scope=SHARED))
    assert result.complete and not result.findings
    assert [i for i in RX_IDS if not result.exercised[i]] == []
    assert RX_IDS == ["RX1", "RX2", "RX3", "RX4", "RX5", "RX6", "RX7", "RX8"]


@pytest.mark.parametrize("cell", [pytest.param(c, marks=() if c == "nov-p1-none-radix"
                                               else pytest.mark.slow) for c in RADIX_CELLS])
def test_the_clean_radix_cells_pass_at_the_shared_scopes_defaults(cell: str,
                                                                   tmp_path: Path) -> None:
    """What ``overlap-spec exhaust --radix`` says of a clean tree at its defaults: complete,
    no finding, every applicable invariant witnessed (RX1-RX7 among them). From 3 s of CPU
    (nov-p1-none-radix, the default tier's) to 26 s a cell, about 4 minutes for the 16
    (bench/results/2026-11-29-exhaust-radix.md); the others are slow, run by .ci/run's
    kill-matrix step (-k "not default_bounds")."""
    config = _config(cell)
    report = run_exhaust_task(ExhaustTask(config, SHARED_DEPTH, frozenset(), tmp_path,
                                          scope=SHARED))
    assert report.default_bounds and report.complete
    assert report.verdict is Verdict.PASS, (report.vacuous, report.stopped, report.others)
    assert all(report.exercised.get(i, 0) > 0 for i in [*report.applicable, *RX_IDS])


# Two radix bugs, each the catalogue's (harness/catalogue.py): the invariant a kill trips
# and the requests the shortest kill needs (a release after any checkpoint takes one; a
# duplicate takes two of one family).
RADIX_MUTANTS = {"B26": ("RX2", 1), "B29": ("RX4", 2)}


@pytest.mark.parametrize("cell", ["nov-p1-none-radix", "ov-p4-v2chain-cpu-honest-radix"])
@pytest.mark.parametrize("bug_id", sorted(RADIX_MUTANTS))
def test_the_shared_scope_kills_radix_mechanisms(
        bug_id: str, cell: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The shared scope finds a release without its unlock (B26, #32170) and a checkpoint
    without its row repoint (B29, mini-sglang #142) within its depth, shortest first; the
    saved script admits one family, fails on replay and passes without the fault, and its
    trace (the tree included) is rejected too."""
    invariant, requests = RADIX_MUTANTS[bug_id]
    report = run_exhaust_task(ExhaustTask(_config(cell), SHARED_DEPTH, frozenset({bug_id}),
                                          tmp_path, scope=SHARED))
    assert report.error is None, report.error  # replayed from scratch, the same violation
    stopped = report.stopped
    assert stopped is not None and stopped.kind == "violation", report.others
    assert invariant in stopped.ids, stopped.message
    assert stopped.ops <= SHARED_DEPTH and stopped.requests == requests
    assert stopped.trace_status == "violation"  # its trace, tree included, checked too
    script = Path(stopped.script)
    loaded = load_script(script)
    assert loaded.faults == (bug_id,)
    assert all(op.family == 0 for op in loaded.ops if isinstance(op, Admit))
    capsys.readouterr()
    assert main(["replay", str(script)]) == 1
    assert stopped.message in capsys.readouterr().out
    assert run_script(replace(loaded, faults=())).violation is None  # the fault fails it


def test_the_radix_cells_through_the_cli(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """--radix selects among the radix cells, over the shared alphabet; a radix cell's name
    without it, a release cell's with it, and the shared alphabet without it are usage
    errors that name the flag."""
    report_path = tmp_path / "report.json"
    assert main(["exhaust", "--radix", "--cells", "nov-p1-none-radix", "--depth", "3",
                 "-j", "1", "-q", "--out", str(tmp_path), "--json", str(report_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("exhaust: every sequence of operations over each cell's alphabet "
                          "(shared), up to depth 3, at most 2 requests, in 1 radix cell")
    cell = json.loads(report_path.read_text())["cells"]["nov-p1-none-radix@minimal"]
    assert cell["alphabet"].startswith("shared alphabet: up to 2 requests; admit(2,2,family=0)")
    assert cell["verdict"] == "pass" and not cell["default_bounds"]
    for argv, error in [
            (["--cells", "nov-p1-none-radix"], "radix cells need --radix"),
            (["--radix", "--cells", "nov-p1-none"],
             "--radix selects among the radix cells only"),
            (["--alphabet", "shared", "--cells", "nov-p1-none"], "add --radix"),
            (["--radix", "--requests", "3"], "the shared alphabet admits at most 2")]:
        assert main(["exhaust", *argv, "--out", str(tmp_path)]) == 2, argv
        assert error in capsys.readouterr().err, argv


def test_a_radix_bug_asks_for_radix_cells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A fault that applies only in radix cells, run without --radix (and one that applies
    only outside them, run with it), applies in none of the selected cells: a usage error
    naming the flag, never a column of survivals."""
    import dataclasses

    from overlap_spec.harness.exhaust import tier

    radix_only = dataclasses.replace(get_bug("B1"), applies=lambda cell: cell.radix)
    monkeypatch.setattr(tier, "get_bug", lambda bug_id: radix_only)
    assert main(["exhaust", "--cells", "nov-p1-none", "--faults", "B1",
                 "--out", str(tmp_path)]) == 2
    assert "B1 applies in none of the selected cells: it applies only in radix cells (add " \
           "--radix)" in capsys.readouterr().err
    elsewhere = dataclasses.replace(get_bug("B1"), applies=lambda cell: not cell.radix)
    monkeypatch.setattr(tier, "get_bug", lambda bug_id: elsewhere)
    assert main(["exhaust", "--radix", "--cells", "nov-p1-none-radix", "--faults", "B1",
                 "--out", str(tmp_path)]) == 2
    assert "it applies only outside the radix cells (drop --radix)" in capsys.readouterr().err
