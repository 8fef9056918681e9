"""The upstream tier's parts that need no sglang: CLI errors, the catalogue and its doc,
the allow-list, the checker's handling of listed findings. (The tier itself on the
release: tests/test_upstream_tier.py, marked ``upstream``.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from overlap_spec.harness.conformance.findings import (
    ALLOWED_DIVERGENCES,
    KNOWN_FINDINGS,
    UPSTREAM_NOT_APPLICABLE,
    DivergenceContext,
    match_finding,
)
from overlap_spec.harness.conformance.tier import UpstreamChecker, explain, get_differences
from overlap_spec.harness.drive.cells import UsageError as CommandUsageError
from overlap_spec.harness.drive.cells import make_preset
from overlap_spec.spec.config import (
    MINIMAL,
    ModelConfig,
    enumerate_cells,
    get_cell,
    get_departures,
)
from overlap_spec.spec.interface import BatchState, ObservableState, RequestState
from overlap_spec.spec.invariants import INVARIANT_IDS, InvariantViolation
from overlap_spec.spec.transitions import compute_draft_writes, compute_forward_write_width
from overlap_spec.spec.units import RequestId
from overlap_spec.upstream.bootstrap import UpstreamUnavailable
from overlap_spec.upstream.session import configure_chunking, is_drivable
from overlap_spec.upstream.standins import STAND_INS
from overlap_spec.upstream.worker import get_paged_tree_gathers

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "upstream-findings.md").read_text()


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "overlap_spec.harness.cli", *args],
                          capture_output=True, text=True, env=env, timeout=120, check=False,
                          cwd=ROOT)


def test_without_an_upstream_environment_the_tier_exits_2_with_one_line(tmp_path: Path) -> None:
    env = dict(os.environ, OVERLAP_SPEC_UPSTREAM_PYTHON=str(tmp_path / "no-python"))
    done = run_cli("upstream", "check", "--cells", "ov-p1-none", env=env)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "cannot run the upstream interpreter" in done.stderr


@pytest.mark.parametrize("here,venv,chosen", [
    ("0.5.23", True, "this environment"),     # the sglang installed here, supported
    ("0.5.22", True, ".venv-upstream"),       # another version here: the frozen copy
    ("0.5.22", False, "this environment"),    # ... or, without one, this (cannot drive)
    (None, True, ".venv-upstream"),           # none here: ./dev upstream's copy
    (None, False, None),                      # none anywhere: a usage error
])
def test_the_tier_drives_the_sglang_of_this_environment_when_it_is_supported(
        here: str | None, venv: bool, chosen: str | None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from overlap_spec.harness.conformance import cli

    monkeypatch.delenv("OVERLAP_SPEC_UPSTREAM_PYTHON", raising=False)
    monkeypatch.setattr(cli, "get_installed_sglang_version", lambda: here)
    monkeypatch.setattr(cli, "REPO_ROOT", tmp_path)
    if venv:
        (tmp_path / ".venv-upstream" / "bin").mkdir(parents=True)
        (tmp_path / ".venv-upstream" / "bin" / "python").touch()
    python, environment = cli.find_upstream_python()
    if chosen is None:
        assert python is None and environment.startswith("none")
        with pytest.raises(CommandUsageError, match="no sglang to drive"):
            cli._require_python()
        return
    assert environment.startswith(chosen), environment
    assert python == (sys.executable if chosen == "this environment"
                      else str(tmp_path / ".venv-upstream" / "bin" / "python"))
    if here is not None and here != "0.5.23":
        assert f"sglang {here}" in environment  # says why it is not this one's


FAKE_SERVER = """#!/bin/sh
# Stands for the upstream interpreter: whatever it is asked, it answers as a cell server
# whose first cell is killed and which then dies before the second cell finishes.
cat <<'END'
{"event": "sglang", "version": "0.5.23", "source": "release"}
{"event": "start", "cell": "ov-p1-none"}
{"event": "start", "cell": "nov-p1-none"}
{"event": "done", "cell": "ov-p1-none", "exit": -9, "wall_s": 1.0, "reason": "killed"}
END
echo "the server's last words" >&2
exit 3
"""


def test_a_crashed_cell_and_a_lost_one_fail_the_tier(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text(FAKE_SERVER)
    fake.chmod(0o755)
    env = dict(os.environ, OVERLAP_SPEC_UPSTREAM_PYTHON=str(fake))
    report = tmp_path / "r.json"
    done = run_cli("upstream", "check", "--cells", "ov-p1-none,nov-p1-none", "--json",
                   str(report), "--out", str(tmp_path), env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    cells = json.loads(report.read_text())["cells"]
    assert cells["ov-p1-none"]["verdict"] == "fail"
    assert "exit -9" in cells["ov-p1-none"]["reason"]
    assert cells["nov-p1-none"]["verdict"] == "fail"
    assert "before this cell finished" in cells["nov-p1-none"]["reason"]
    assert "the server's last words" in cells["nov-p1-none"]["reason"]


def test_sglang_failing_to_import_in_the_server_is_a_usage_error(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho '{\"event\": \"error\", \"message\": "
                    "\"sglang does not import: ImportError: x\"}'\nexit 2\n")
    fake.chmod(0o755)
    env = dict(os.environ, OVERLAP_SPEC_UPSTREAM_PYTHON=str(fake))
    done = run_cli("upstream", "check", "--cells", "ov-p1-none", env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and "sglang does not import" in done.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["upstream", "check", "--sglang-src", "/nonexistent/tree"], "no such directory"),
    (["upstream", "check", "--sglang-src", "."], "not an SGLang tree"),
    (["upstream", "check", "--cells", "no-such-cell"], "no cell matches"),
    (["upstream", "check", "--json", "."], "is a directory"),
    (["upstream", "check", "--json", "/nonexistent/dir/r.json"], "does not exist"),
    (["upstream", "replay"], "needs a script file"),
    (["upstream", "replay", "/nonexistent.json"], "no such file"),
])
def test_bad_input_exits_2_before_running(args: list[str], message: str) -> None:
    done = run_cli(*args, env=dict(os.environ))
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1


def test_stand_ins_and_findings_are_listed() -> None:
    done = run_cli("upstream", "stand-ins", env=dict(os.environ))
    assert done.returncode == 0
    headers = [line for line in done.stdout.splitlines() if not line.startswith(" ")]
    assert len(headers) == len(STAND_INS)
    assert all(line.endswith(("[replaced]", "[observed]")) for line in headers)
    assert "Scheduler.init_model_worker" in done.stdout
    listing = run_cli("upstream", "findings", env=dict(os.environ))
    assert listing.returncode == 0
    for known in KNOWN_FINDINGS:
        assert known.id in listing.stdout


def test_doc_lists_every_finding_allowed_divergence_and_unjudged_id() -> None:
    for known in KNOWN_FINDINGS:
        row = re.search(rf"^\| {known.id} \| {known.invariant} \|", DOC, re.MULTILINE)
        assert row, f"docs/upstream-findings.md has no row for {known.id}"
    for entry in ALLOWED_DIVERGENCES:
        assert re.search(rf"^\| {entry.id} \|", DOC, re.MULTILINE), entry.id
    for invariant_id in UPSTREAM_NOT_APPLICABLE:
        assert invariant_id in INVARIANT_IDS
        assert invariant_id in DOC


def test_findings_match_by_id_text_and_cell() -> None:
    spec = get_cell("ov-p1-v2chain-cpu-honest")
    non_spec = get_cell("ov-p1-none")
    rp3 = InvariantViolation("RP3", "for the result of step 2: num_correct_drafts=3, batch "
                                    "size 1; live requests give 0 and 0 at process_result")
    assert match_finding(rp3, spec) is not None and match_finding(rp3, spec).id == "U3"
    assert match_finding(rp3, non_spec) is None  # U3 is a spec finding
    other = InvariantViolation("SL4", "for the batch: lengths differ {'reqs': 2, 'seq_lens': 1}")
    assert match_finding(other, spec) is None  # SL4 is no finding (U1 retired)
    # U6 under RP7: a stop token inside the visible output, or (the newest token checked
    # alone) a token right after it; a wrong token after any other token is no finding.
    after_stop = InvariantViolation("RP7", "for request r0: output token 2 is 7; the "
                                           "environment emitted 22 at position 3 after 0")
    inside = InvariantViolation("RP7", "for request r0: output token 1 is 0; the environment "
                                       "emitted 9 at position 2 after 41 (EOS only ends the "
                                       "output)")
    for violation in (after_stop, inside):
        found = match_finding(violation, spec)
        assert found is not None and found.id == "U6", violation
        assert match_finding(violation, non_spec) is None
    wrong = InvariantViolation("RP7", "for request r0: output token 2 is 7; the environment "
                                      "emitted 22 at position 3 after 41")
    assert match_finding(wrong, spec) is None
    near = InvariantViolation("RP7", "for request r0: output token 2 is 7; the environment "
                                     "emitted 22 at position 3 after 05")
    assert match_finding(near, spec) is None
    # U7: a page-1 tree's allocation past its req_to_token row, as KV1 says it, and its
    # consequences as KV4, KV7 and the release's own bare assert name them; only in page-1
    # tree cells, and never a KV1 without the row's overflow.
    tree = get_cell("ov-p1-v2tree-cpu-honest")
    row = InvariantViolation("KV1", "for request r1: kv_committed_len=245, kv_allocated_len="
                                    "269, row width=268 (allocated past the row) at x")
    slots = InvariantViolation("KV4", "for request r2: req_to_token position 0 holds slot 9 "
                                      "outside its pages (r1 allocated past its row) at x")
    bare = InvariantViolation("UC", "(upstream's own checker): AssertionError at srt/managers/"
                                    "scheduler_components/invariant_checker.py:359 in "
                                    "_add_owner (op 3, cell c)")
    for violation in (row, slots, bare):
        found = match_finding(violation, tree)
        assert found is not None and found.id == "U7" and found.halts, violation
        assert match_finding(violation, spec) is None
    order = InvariantViolation("KV1", "for request r1: kv_committed_len=9, kv_allocated_len=8, "
                                      "row width=268 at x")
    assert match_finding(order, tree) is None


def test_a_halting_finding_stops_judging_the_rest_of_its_run() -> None:
    """After U7 the release has written past a row: the checker records it and judges
    nothing more in that run (said by replay), where another finding is judged on."""
    config = ModelConfig(get_cell("ov-p1-v2tree-cpu-honest"), MINIMAL)
    checker = UpstreamChecker(config)
    checker.on_upstream_check("AssertionError at srt/managers/scheduler_components/"
                              "invariant_checker.py:359 in _add_owner", 4)
    assert checker.halted_by == "U7" and checker.findings["U7"] == 1
    checker.on_upstream_check("Full Pool Mem Leak Detected! ...", 5)  # not judged now
    assert checker.findings["U7"] == 1 and checker.exercised["UC"] == 1
    listed = UpstreamChecker(config)
    with pytest.raises(InvariantViolation):
        listed.on_upstream_check("Full Pool Mem Leak Detected! ...", 5)


def _state(requests: tuple[RequestState, ...], running: BatchState | None = None,
           free: int = 30) -> ObservableState:
    return ObservableState(requests, running, None, free, 0, (0, 0), 0.7, False)


def _request(rid: int, status: str, committed: int, allocated: int,
             output: tuple[int, ...] = (5,)) -> RequestState:
    return RequestState(RequestId(rid), status, output, committed, allocated,
                        tuple(range(1, allocated + 1)) if status != "finished" else (), 1,
                        "length" if status == "finished" else None, 0, 0)


def _context(ref: ObservableState, up: ObservableState, up_retracted: set[int] | None = None,
             is_spec: bool = False) -> DivergenceContext:
    return DivergenceContext(ref, up, frozenset(up_retracted or ()), is_spec)


def test_allowed_divergences_explain_only_what_they_name() -> None:
    # A1 is retired: both zero kv_allocated_len at a release, so a released request whose
    # allocation differs is explained by nothing.
    ref = _state((_request(0, "finished", 3, 3),))
    up = _state((_request(0, "finished", 3, 0),))
    used, unexplained = explain(get_differences(ref, up), _context(ref, up))
    assert unexplained is not None and unexplained[0] == "request r0.kv_allocated_len"
    assert {e.id for e in ALLOWED_DIVERGENCES}.isdisjoint({"A1", "A3", "A6"})
    # A different committed length of a running request is explained by nothing.
    ref = _state((_request(0, "running", 4, 4),))
    up = _state((_request(0, "running", 3, 4),))
    used, unexplained = explain(get_differences(ref, up), _context(ref, up))
    assert unexplained is not None and unexplained[0] == "request r0.kv_committed_len"
    # A retraction of a different request is explained by nothing, with speculation or
    # without (A6, spec's older retraction order, is retired: both sort alike, #32023).
    ref = _state((_request(0, "running", 4, 4), _request(1, "waiting", 0, 0)))
    up = _state((_request(0, "waiting", 0, 0), _request(1, "running", 4, 4)))
    for is_spec in (True, False):
        both_retracted = _context(ref, up, {0}, is_spec=is_spec)
        assert explain(get_differences(ref, up), both_retracted)[1] is not None
    # A11 is retired: the same batch in another member order is a divergence.
    assert {e.id for e in ALLOWED_DIVERGENCES}.isdisjoint({"A2", "A7", "A10", "A11"})
    running = (_request(0, "running", 4, 4), _request(1, "running", 4, 4))
    ref = replace(_state(running), running=BatchState((RequestId(0), RequestId(1)), (4, 4),
                                                      (4, 4), None))
    up = replace(ref, running=BatchState((RequestId(1), RequestId(0)), (4, 4), (4, 4), None))
    used, unexplained = explain(get_differences(ref, up), _context(ref, up))
    assert unexplained is not None and unexplained[0] == "running.rids"


def test_slot_numbering_is_not_a_divergence_but_layout_is() -> None:
    a = _state((RequestState(RequestId(0), "running", (), 2, 2, (4, 5), None, None, 0, 0),))
    b = _state((RequestState(RequestId(0), "running", (), 2, 2, (9, 10), None, None, 0, 0),))
    assert get_differences(a, b, page_size=1) == []
    shared = _state((RequestState(RequestId(0), "running", (), 2, 2, (4, 4), None, None, 0, 0),))
    assert get_differences(a, shared, page_size=1)


def test_checker_sets_listed_findings_aside_and_raises_the_rest() -> None:
    from overlap_spec.harness.drive.script import Script

    checker = UpstreamChecker(ModelConfig(get_cell("ov-p1-v2chain-cpu-honest"), MINIMAL))
    checker.script = Script("ov-p1-v2chain-cpu-honest", "minimal", [])
    assert not {i.id for i in checker.applicable} & set(UPSTREAM_NOT_APPLICABLE)
    checker.on_upstream_check(None, 0)
    assert checker.exercised["UC"] == 1
    with pytest.raises(InvariantViolation) as raised:
        checker.on_upstream_check("Full Pool Mem Leak Detected! ...", 3)
    assert raised.value.invariant_id == "UC"


def test_cells_the_adapter_cannot_drive_say_why() -> None:
    """Every cell that is the release's own (no era, no proposal) is driven: 16 of 32."""
    drivable = [c for c in ("ov-p1-none", "ov-p4-none", "nov-p1-none", "nov-p4-none",
                            "ov-p1-v2chain-cpu-honest", "ov-p1-v2chain-nocpu-honest",
                            "ov-p4-v2chain-cpu-honest", "ov-p4-v2chain-nocpu-honest",
                            "nov-p1-v2chain-cpu-honest", "nov-p4-v2chain-cpu-honest",
                            "ov-p1-v2tree-cpu-honest", "ov-p1-v2tree-nocpu-honest",
                            "nov-p1-v2tree-cpu-honest", "ov-p4-v2tree-cpu-honest",
                            "ov-p4-v2tree-nocpu-honest", "nov-p4-v2tree-cpu-honest")]
    assert len(drivable) == 16 and len(enumerate_cells()) == 32
    assert set(drivable) == {c.name for c in enumerate_cells() if not get_departures(c)}
    for name in drivable:
        assert is_drivable(ModelConfig(get_cell(name), MINIMAL)) is None, name
    for cell in enumerate_cells():  # every other cell: an era, a proposal, or not drivable
        if cell.name not in drivable:
            reason = is_drivable(ModelConfig(cell, MINIMAL))
            assert reason and len(reason) > 20, cell.name
    early = is_drivable(ModelConfig(get_cell("ov-p1-v2chain-cpu-honest-earlyfence"), MINIMAL))
    assert early and "proposal" in early


def test_the_stand_in_addresses_a_page_tree_as_the_release_does() -> None:
    """A tree on pages > 1 (``prepare_for_draft``): the stand-in gathers from the row every
    draft slot and every tail copy's target and source (``torch.gather``, which raises past
    the row as the release's does on CPU), all inside the branch regions, which lie within
    ``[s - lp, s - lp + A)``; the decode's reported width is 6 or 10 by ``s % 4`` at the
    minimal shape (docs/upstream-page-trees.md section 3)."""
    config = ModelConfig(get_cell("ov-p4-v2tree-cpu-honest"), MINIMAL)
    shape, page = config.get_shape(), config.page_size
    widths = {}
    for seq_len in range(1, 6 * page):
        slots, copies = compute_draft_writes(seq_len, shape, page)
        gathers = get_paged_tree_gathers(seq_len, shape, page)
        assert set(slots) | {t for t, _ in copies} | {src for _, src in copies} <= set(gathers)
        base = seq_len - seq_len % page
        assert base <= min(gathers) and max(gathers) < base + config.alloc_len_per_decode
        widths[seq_len % page] = int(compute_forward_write_width(shape, "decode", page,
                                                                 seq_len))
    assert widths == {0: 6, 1: 6, 2: 6, 3: 10}
    assert any("tree on pages > 1" in x.target for x in STAND_INS)


def test_the_upstream_environment_is_looked_for_at_the_repository_root() -> None:
    """A wrong root silently skips the upstream tier ("no upstream environment")."""
    from overlap_spec.harness.conformance.cli import REPO_ROOT

    assert (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "upstream").is_dir()


def test_the_release_chunks_at_the_presets_size_and_never_mixes() -> None:
    """chunked_prefill_size 0: a release that could split a prompt the preset draws is not
    compared; > 0: the built scheduler chunks at the preset's size (ServerArgs alone is
    resolved again from the memory tier). A mixed chunk is refused either way."""

    def release(chunk: int | None, mixed: bool = False) -> SimpleNamespace:
        return SimpleNamespace(chunked_prefill_size=chunk, is_mixed_chunk=mixed,
                               dynamic_chunk_sizer=None, truncation_align_size=None)

    config = ModelConfig(get_cell("ov-p1-none"), MINIMAL)
    longest = MINIMAL.max_context_len - 1
    for chunk in (None, 4096, longest + 1):  # 0.5.23 resolves 4096 here
        sched = release(chunk)
        configure_chunking(config, sched)
        assert sched.chunked_prefill_size == chunk
    for chunk, mixed in ((longest, False), (4, False), (4096, True)):
        with pytest.raises(UpstreamUnavailable, match="chunk"):
            configure_chunking(config, release(chunk, mixed))
    chunked = ModelConfig(get_cell("ov-p4-none"), make_preset("minimal",
                                                              {"chunked_prefill_size": 4}))
    sched = release(4096)
    configure_chunking(chunked, sched)
    assert sched.chunked_prefill_size == 4
    with pytest.raises(UpstreamUnavailable, match="mix"):
        configure_chunking(chunked, release(4096, mixed=True))
    with pytest.raises(UpstreamUnavailable, match="dynamically"):
        configure_chunking(chunked, SimpleNamespace(
            chunked_prefill_size=4096, is_mixed_chunk=False, dynamic_chunk_sizer=object()))
    unaligned = ModelConfig(get_cell("ov-p4-none"), make_preset("minimal",
                                                                {"chunked_prefill_size": 6}))
    with pytest.raises(UpstreamUnavailable, match="page"):
        configure_chunking(unaligned, release(4096))


def test_accept_counters_that_differ_are_explained_by_nothing() -> None:
    """A8 is retired: the differential's reference runs with B4 (current upstream), so a
    difference in the accept counters is a divergence, in spec cells too."""
    assert "A8" not in {e.id for e in ALLOWED_DIVERGENCES}
    ref = _state((_request(0, "running", 4, 4),))
    up = replace(ref, accept_counters=(ref.accept_counters[0] + 1, ref.accept_counters[1] + 2))
    used, unexplained = explain(get_differences(ref, up), _context(ref, up, is_spec=True))
    assert unexplained is not None and unexplained[0] == "accept_counters"


def test_the_differential_reference_runs_with_the_current_upstream_bugs() -> None:
    """The reference the differential compares carries exactly the catalogue's bugs that
    are the release's behaviour in that cell (Bug.current_upstream and Bug.applies)."""
    from overlap_spec.harness.catalogue import BUGS
    from overlap_spec.harness.conformance.tier import get_release_faults

    expected = {"ov-p1-none": {"B14"}, "nov-p1-none": set(),
                "ov-p1-v2chain-cpu-honest": {"B4", "B14", "B17"},
                "nov-p1-v2chain-cpu-honest": {"B17"}, "ov-p1-v2tree-nocpu-honest":
                {"B4", "B14", "B17", "B23"}, "nov-p1-v2tree-cpu-honest": {"B17", "B23"},
                "ov-p4-v2tree-cpu-honest": {"B4", "B14", "B17"},
                "ov-p4-v2tree-nocpu-honest": {"B4", "B14", "B17"},
                "nov-p4-v2tree-cpu-honest": {"B17"}}
    for name, faults in expected.items():
        assert get_release_faults(get_cell(name)) == faults, name
    current = {bug.id for bug in BUGS if bug.current_upstream}
    drivable = [c for c in enumerate_cells() if not get_departures(c)]
    seen = set().union(*(get_release_faults(c) for c in drivable))
    # B10 is current upstream only in the trimmed finish's cells, a proposal not driven.
    assert seen == current - {"B10"}


def test_the_reference_processes_early_only_where_the_release_did() -> None:
    from overlap_spec.harness.conformance.tier import as_the_release_read_it
    from overlap_spec.harness.drive.script import Abort, Iterate
    from overlap_spec.spec.state import IterationChoices

    asked = Iterate(IterationChoices(disable_overlap=True, retract=1))
    assert as_the_release_read_it(asked, False) == Iterate(
        IterationChoices(disable_overlap=False, retract=1))
    assert as_the_release_read_it(asked, True) == asked
    plain = Iterate(IterationChoices())
    assert as_the_release_read_it(plain, True).choices.disable_overlap  # type: ignore[union-attr]
    assert as_the_release_read_it(Abort(0), True) == Abort(0)


def test_a_reference_crash_in_the_differential_is_a_failure_with_its_script(
        tmp_path: Path) -> None:
    """The differential records the shortest failing script; a reference crash is saved
    like a divergence and reported as the differential's error, never as agreement."""
    from overlap_spec.harness.conformance.tier import DifferentialReport, finish_differential
    from overlap_spec.harness.drive.script import Admit, Iterate, Script, load_script
    from overlap_spec.spec.state import IterationChoices

    config = ModelConfig(get_cell("ov-p1-none"), MINIMAL)
    long = Script.for_config(config, [Admit(3, 4), Iterate(IterationChoices()),
                                      Iterate(IterationChoices())], (), "upstream")
    short = replace(long, ops=long.ops[:2])
    report = DifferentialReport()
    report.record(long, 2, "request r0.output_ids", "(1,)", "(1, 2)")
    report.record(short, 1, "reference crashed", "ValueError: boom", "ran")
    report.record(long, 2, "request r0.kv_committed_len", "3", "4")  # longer: not kept
    finish_differential(report, config, 7, tmp_path, minimize=False, replay=False)
    assert report.divergence is not None and report.divergence["field"] == "reference crashed"
    assert report.error == "the reference crashed: ValueError: boom"
    saved = load_script(Path(report.divergence["script"]))
    assert saved.implementation == "upstream-differential" and saved.seed == 7
    assert saved.ops == short.ops


# ---------------------------------------------------------------------- compat (no sglang)
UPSTREAM_DIR = Path(__file__).resolve().parents[1] / "upstream"
FAKE_UPSTREAM = '''
class Base:
    def __init__(self):
        self.inherited = 1

class Scheduler(Base):
    flag = True

    def __init__(self, a, b=2):
        super().__init__()
        self.chunked_req = None

    def run_batch(self, batch, *args, key=None, **kwargs):
        return batch

    @staticmethod
    def helper(x, /, y):
        return x

def build(*, server_args, model_config):
    return None

def loose(**kwargs):
    return kwargs
'''


@pytest.fixture
def fake_upstream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "fake_upstream_mod.py").write_text(FAKE_UPSTREAM)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("fake_upstream_mod", None)
    return "fake_upstream_mod"


def test_compat_finds_each_kind_of_change(fake_upstream: str) -> None:
    from overlap_spec.upstream.compat import Need, check_need, get_mismatches

    m = fake_upstream
    ok = [Need(m, "", "module", "u"), Need(m, "Scheduler", "class", "u"),
          Need(m, "Scheduler.run_batch", "callable", "u",
               signature="(self, batch, *args, key=, **kwargs)"),
          Need(m, "Scheduler.helper", "callable", "u", signature="(x, /, y)"),
          Need(m, "Scheduler", "callable", "u", accepts=("a", "b")),
          Need(m, "loose", "callable", "u", accepts=("anything",)),
          Need(m, "build", "callable", "u", signature="(*, server_args, model_config)"),
          Need(m, "Scheduler.chunked_req", "attribute", "u"),
          Need(m, "Scheduler.inherited", "attribute", "u"),
          Need(m, "Scheduler.flag", "attribute", "u")]
    assert [check_need(n) for n in ok] == [None] * len(ok)
    bad = {
        Need(m, "Scheduler.process_pending", "callable", "u", signature="(self)"):
            f"missing: {m}.Scheduler has no 'process_pending'",
        Need(m, "Scheduler.run_batch", "callable", "u", signature="(self, batch)"):
            "signature changed: now (self, batch, *args, key=, **kwargs), the tier expects "
            "(self, batch)",
        Need(m, "Scheduler", "callable", "u", accepts=("a", "c")):
            "no longer accepts c (signature now (a, b=))",
        Need(m, "Scheduler.waiting_queue", "attribute", "u"):
            f"missing: {m}.Scheduler no longer has an attribute 'waiting_queue'",
        Need(m, "build", "class", "u"): f"{m}.build is no longer a class",
        Need("no_such_module_here", "X", "callable", "u", signature="()"):
            "module no_such_module_here does not import",
    }
    for need, change in bad.items():
        found = check_need(need)
        assert found is not None and found.startswith(change), (need, found)
    mismatches = get_mismatches(tuple(bad))
    assert [x.hook for x in mismatches] == [n.hook for n in bad]
    assert mismatches[0].line() == (f"cannot drive this sglang: Scheduler.process_pending: "
                                    f"missing: {m}.Scheduler has no 'process_pending'")


def test_compat_table_renders_every_row_and_counts_the_missing(fake_upstream: str) -> None:
    from overlap_spec.upstream.compat import Need, check_compat, render_compat

    needs = (Need(fake_upstream, "Scheduler.run_batch", "callable", "u",
                  signature="(self, batch)"),
             Need(fake_upstream, "Scheduler.gone", "callable", "u", signature="(self)"),
             Need(fake_upstream, "Scheduler.chunked_req", "attribute", "u"))
    text = render_compat(check_compat(needs))
    rows = {line.split()[0]: line.split()[2] for line in text.splitlines()[1:4]}
    assert rows == {"Scheduler.run_batch": "CHANGED", "Scheduler.gone": "MISSING",
                    "Scheduler.chunked_req": "ok"}
    assert "1/3 names present" in text and "2 missing or changed" in text


def _sglang_imports(tree: Any) -> set[tuple[str, str]]:
    import ast

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang"):
            found |= {(node.module or "", alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {(alias.name, "") for alias in node.names
                      if alias.name.startswith("sglang")}
    return found


def test_every_sglang_import_of_the_tier_is_in_the_compat_list() -> None:
    import ast

    from overlap_spec.upstream.compat import NEEDS

    listed = {(n.module, n.name.split(".")[0]) for n in NEEDS} | {(n.module, "") for n in NEEDS}
    imports = set()
    for path in sorted(UPSTREAM_DIR.glob("*.py")):
        imports |= _sglang_imports(ast.parse(path.read_text()))
    # Submodules imported as names (``from sglang.srt.managers import scheduler``) are
    # modules in the list.
    unlisted = {(m, n) for m, n in imports
                if (m, n) not in listed and (f"{m}.{n}", "") not in listed}
    assert len(imports) > 20 and unlisted == set(), unlisted


# The names the tier's files give the release's objects, and the class each one is.
RECEIVERS = {"sched": "Scheduler", "self.scheduler": "Scheduler", "req": "Req",
             "track.req": "Req", "chunked": "Req", "r": "Req", "batch": "ScheduleBatch",
             "running_batch": "ScheduleBatch", "sched.running_batch": "ScheduleBatch",
             "req.kv": "ReqKvInfo", "chunked.kv": "ReqKvInfo", "middle.kv": "ReqKvInfo",
             "track.req.kv": "ReqKvInfo", "future_map": "FutureMap",
             "req.sampling_params": "SamplingParams", "r.sampling_params": "SamplingParams",
             "mode": "ForwardMode", "forward_mode": "ForwardMode",
             "forward_batch": "ForwardBatch", "draft_input": "EagleDraftInput",
             "verify_input": "EagleVerifyInput", "plan": "KVLocPlan",
             "self.target.kv_index_translator": "KVIndexTranslator",
             "self.target.spec_algorithm": "SpeculativeAlgorithm",
             "self.draft.spec_algorithm": "SpeculativeAlgorithm"}
# Set on the scheduler by the stand-in init_model_worker (what the real one sets), or the
# ingest hook the session replaces per instance: written, not relied on.
WRITTEN_BY_THE_TIER = {"ingest_requests", "tp_worker", "model_worker", "draft_worker",
                       "max_total_num_tokens", "max_running_requests", "max_prefill_tokens",
                       "max_req_len", "device", "random_seed", "max_queued_requests",
                       "min_free_slots_delayer", "forward_stream", "schedule_stream",
                       "tp_group", "tp_cpu_group", "attn_tp_group", "attn_tp_cpu_group",
                       "attn_cp_group", "attn_cp_cpu_group", "pp_group", "world_group",
                       "dp_tp_group", "dp_tp_cpu_group", "pad_input_ids_func",
                       "kv_cache_allocation_time"}
# Set as the release sets it on a draft input it builds a batch from (prepare_for_draft,
# eagle_worker_common.py:357); the class declares no such name to look up.
SET_AS_THE_RELEASE_SETS = {("EagleDraftInput", "positions")}


def test_every_attribute_the_tier_reads_off_the_release_is_in_the_compat_list() -> None:
    """``sched.chunked_req``, ``req.kv.kv_committed_len``, ``batch.spec_info``...: every
    attribute or method the adapter, hooks, session and worker use on the release's
    scheduler, batches, requests and relay is a listed need of that class."""
    import ast

    from overlap_spec.upstream.compat import NEEDS

    listed = {tuple(n.name.split(".", 1)) for n in NEEDS if "." in n.name}
    used: set[tuple[str, str]] = set()
    for name in ("adapter.py", "hooks.py", "session.py", "worker.py", "forward_batch.py"):
        for node in ast.walk(ast.parse((UPSTREAM_DIR / name).read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) in RECEIVERS:
                used.add((RECEIVERS[ast.unparse(node.value)], node.attr))
    unlisted = {u for u in used if u not in listed and u not in SET_AS_THE_RELEASE_SETS
                and not (u[0] == "Scheduler" and u[1] in WRITTEN_BY_THE_TIER)}
    # The forward batch's reads are scanned too (it cannot drop out of the scan unseen).
    assert {("ForwardBatch", "seq_lens_sum"), ("KVLocPlan", "write_virtual")} <= used
    assert len(used) > 60 and unlisted == set(), sorted(unlisted)


def test_every_name_the_tier_patches_is_in_the_compat_list() -> None:
    """``X.name = ...`` where X is an sglang module or class the tier imported (hooks.py,
    session.py): the wrapped and replaced names are listed (the upstream tests compare a
    built session's modules before and after, too)."""
    import ast

    from overlap_spec.upstream.compat import NEEDS

    aliases = {"sb": "ScheduleBatch", "cls": "Scheduler", "scheduler_module": "",
               "allocation": "", "overlap_utils": "", "SchedulerMetricsReporter":
               "SchedulerMetricsReporter", "scheduler_module.Scheduler": "Scheduler",
               "scheduler_module.kv_cache_builder": "kv_cache_builder",
               "overlap_utils.FutureMap": "FutureMap"}
    listed = {n.name for n in NEEDS}
    patched = set()
    for name in ("hooks.py", "session.py"):
        for node in ast.walk(ast.parse((UPSTREAM_DIR / name).read_text())):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if (isinstance(target, ast.Attribute)
                            and ast.unparse(target.value) in aliases):
                        owner = aliases[ast.unparse(target.value)]
                        patched.add(f"{owner}.{target.attr}" if owner else target.attr)
    assert {"ScheduleBatch.prepare_for_extend", "Scheduler.run_batch",
            "kv_cache_builder.build_kv_cache", "assign_req_to_token_pool_func",
            "FutureMap.stash", "TEST_RETRACT_INTERVAL"} <= patched
    assert patched - listed == set(), sorted(patched - listed)


def test_every_stand_in_names_listed_sglang_names() -> None:
    """The stand-ins' targets (upstream/standins.py) that name a method or module global
    are in the compat list."""
    from overlap_spec.upstream.compat import NEEDS
    from overlap_spec.upstream.standins import STAND_INS

    listed = {n.name for n in NEEDS}
    named = set()
    for stand_in in STAND_INS:
        named |= set(re.findall(r"\b((?:Scheduler|ScheduleBatch|FutureMap|"
                                r"SchedulerMetricsReporter|SchedulerInvariantChecker)"
                                r"\.\w+)", stand_in.target))
    assert len(named) > 10
    unlisted = {n for n in named if n not in listed and n != "Scheduler.chunked_prefill_size"}
    assert unlisted == set(), unlisted


def test_a_tree_is_labelled_by_its_own_version_and_commit(tmp_path: Path) -> None:
    """Not the installed release's metadata: the tree's _version.py, else a literal in
    version.py, else git describe; and the checkout's commit, modified or not."""
    from overlap_spec.upstream.bootstrap import describe_package, read_tree_version

    package = tmp_path / "python" / "sglang"
    package.mkdir(parents=True)
    # version.py as upstream's checkout has it: no literal, it asks the installed metadata.
    (package / "version.py").write_text(
        "import importlib.metadata\n__version__ = importlib.metadata.version('sglang')\n")
    (package / "__init__.py").write_text("from sglang.version import __version__\n")
    assert read_tree_version(package) == "unknown"
    described = describe_package(package, release=False, installed_version="0.5.23")
    assert described.version == "unknown" and described.commit is None
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    subprocess.run([*git, "tag", "v0.5.30"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    described = describe_package(package, release=False, installed_version="0.5.23")
    assert described.version == "0.5.30 (git describe)"
    assert (described.commit, described.modified) == (head, False)
    (package / "__init__.py").write_text("# edited\n")
    described = describe_package(package, release=False, installed_version="0.5.23")
    assert described.modified is True
    assert described.describe() == (f"sglang 0.5.30 (git describe) at commit {head} "
                                    f"(modified) ({package})")
    # A copy lying untracked inside that checkout is not the checkout's commit or tag.
    copy = tmp_path / "untracked" / "sglang"
    copy.mkdir(parents=True)
    (copy / "version.py").write_text((package / "version.py").read_text())
    stray = describe_package(copy, release=False, installed_version="0.5.23")
    assert (stray.version, stray.commit, stray.modified) == ("unknown", None, False)
    (package / "_version.py").write_text("__version__ = version = '0.5.31.dev2'\n")
    assert read_tree_version(package) == "0.5.31.dev2"
    release = describe_package(package, release=True, installed_version="0.5.23")
    assert (release.version, release.source, release.commit) == ("0.5.23", "release", None)


def _report_with(mismatches: list[dict[str, str]]) -> dict[str, Any]:
    from overlap_spec.harness.conformance.cli import _undrivable_cell
    from overlap_spec.harness.conformance.report import build_report

    args = SimpleNamespace(sglang_src=Path("/src"), seed=1, profile="ci", preset="minimal",
                           sizes=None)
    cells = {c: _undrivable_cell(mismatches) for c in ("ov-p1-none", "nov-p1-none")}
    return build_report(cells, {"version": "0.5.24", "source": "/src/python/sglang",
                                "commit": "abc1234", "modified": False},
                        args,  # type: ignore[arg-type]
                        1.0, mismatches)


def test_an_undrivable_sglang_is_reported_per_cell_and_exits_3() -> None:
    from overlap_spec.harness.conformance.report import render_report, upstream_tier_report
    from overlap_spec.harness.verdict import CheckReport, TierReport, Verdict

    mismatch = {"hook": "Scheduler.run_batch", "change": "missing: ..."}
    report = _report_with([mismatch])
    assert report["ok"] is False and report["cannot_drive"] == [mismatch]
    text = render_report(report)
    assert text.startswith("sglang 0.5.24 at commit abc1234 (/src/python/sglang), seed 1")
    said = [x.strip() for x in text.splitlines() if "cannot drive this sglang" in x]
    assert said == ["cannot drive this sglang: Scheduler.run_batch: missing: ..."] * 2
    tier = upstream_tier_report(report)
    assert tier.verdict is Verdict.CANNOT_DRIVE and tier.verdict.fails_run
    run = CheckReport(seed=1, profile="ci")
    run.add(TierReport("hypothesis", Verdict.PASS, "2/2 cells clean"))
    run.add(tier)
    assert not run.ok and run.exit_code == 3
    assert run.closing_line().startswith("CANNOT DRIVE SGLANG: 2/2 cells clean, UPSTREAM")
    # A violation elsewhere outranks it: exit 1.
    run.add(TierReport("mutants", Verdict.FAIL, "MUTANTS FAILED"))
    assert run.exit_code == 1
    run.interrupt("mutants")
    assert run.exit_code == 130


def test_exit_codes_of_a_check_report() -> None:
    from overlap_spec.harness.verdict import CheckReport, TierReport, Verdict

    def code(*verdicts: Verdict) -> int:
        run = CheckReport(seed=1, profile="ci")
        for i, v in enumerate(verdicts):
            run.add(TierReport(f"t{i}", v, "x"))
        return run.exit_code

    assert code(Verdict.PASS, Verdict.SKIPPED, Verdict.NOT_APPLICABLE) == 0
    assert code(Verdict.PASS, Verdict.VACUOUS) == 1
    assert code(Verdict.INCONCLUSIVE, Verdict.CANNOT_DRIVE) == 1
    assert code(Verdict.CANNOT_DRIVE) == 3
    assert code() == 0
