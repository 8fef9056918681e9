"""``overlap-spec review``: the reviewer's path. It answers, it groups a failure that shows
in many cells into one block, and it is interrupted cleanly; ``check`` too."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import hypothesis
import pytest

from overlap_spec.harness.cli import main
from overlap_spec.harness.drive.stateful import CellResult
from overlap_spec.harness.report import get_failure_signature, render_failures
from overlap_spec.spec.config import PRESETS, ModelConfig, get_cell
from overlap_spec.spec.invariants import INVARIANT_IDS, InvariantViolation

# B3 lives in each (the pre-claim era's spec overlap cells)
CELLS = "ov-p1-v2chain-cpu-preclaim,ov-p4-v2chain-cpu-preclaim,ov-p1-v2tree-cpu-preclaim"


def test_review_of_the_reference_passes(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["review", "--cells", CELLS, "-j", "1", "-q", "--json",
                 str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[-1].startswith("OK: 3/3 cells clean")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] and report["profile"] == "quick"
    assert set(report["tiers"]) == {"hypothesis"}
    # A seed replays the same search only under the Hypothesis version that ran it.
    assert report["hypothesis_version"] == hypothesis.__version__, report.get(
        "hypothesis_version")


def test_review_groups_one_bug_seen_in_several_cells_into_one_block(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["review", "--cells", CELLS, "--faults", "B3", "-j", "1", "-q",
                 "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    # B3 shows as KV6 (a request finished since loses its refund) or KV5 (one retracted
    # since gains committed KV), each with RP1 (a stale row's commit changed): one block per
    # mechanism, each cell in exactly one, one replay line per block.
    # A long cell list wraps onto indented lines of cell names.
    name = r"[\w.\[\]=,-]+@\w+(?:\[[^\]]*\])?"
    blocks = re.findall(rf"^\[(\d+)\] in (\d+) cells?: ((?:{name},? ?)+(?:\n +(?:{name},? ?)+)*)$",
                        out, re.MULTILINE)
    assert f"failures: {len(blocks)} distinct, in 3 cells" in out, out
    assert out.count("replay: overlap-spec replay") == len(blocks) < 3, out
    listed = [c.split("@")[0] for _, _, cells in blocks
              for c in re.split(r",\s*", " ".join(cells.split()))]
    assert sorted(listed) == sorted(CELLS.split(",")), out
    first = out[out.index("[1] in "):]
    assert "[1] in 2 cells" in out or "[1] in 3 cells" in out, out
    assert "RP1 violated" in first.split("[2]")[0] and "counterexample:" in first


def _result(cell: str, invariant: str, message: str) -> CellResult:
    config = ModelConfig(get_cell(cell), PRESETS["minimal"])
    result = CellResult(config, frozenset(), 1, "quick", 0.0)
    result.violation = InvariantViolation(invariant, message)
    return result


def test_failures_are_grouped_by_invariant_and_message_shape_not_by_numbers() -> None:
    same_a = _result("ov-p1-none", "KV1", "for request r3: kv_committed_len=9 > "
                     "kv_allocated_len=8 at process_result (op 4, cell ov-p1-none@minimal)")
    same_b = _result("ov-p4-none", "KV1", "for request r1: kv_committed_len=12 > "
                     "kv_allocated_len=4 at process_result (op 7, cell ov-p4-none@minimal)")
    other_place = _result("nov-p1-none", "KV1", "for request r1: kv_committed_len=12 > "
                          "kv_allocated_len=4 at filter_batch (op 7, cell nov-p1-none@minimal)")
    other_id = _result("nov-p4-none", "KV2", "for request r1: kv_committed_len=12 > "
                       "kv_allocated_len=4 at process_result")
    assert get_failure_signature(same_a) == get_failure_signature(same_b)
    assert get_failure_signature(same_a) != get_failure_signature(other_place)
    assert get_failure_signature(same_a) != get_failure_signature(other_id)
    text = render_failures([same_a, same_b, other_place, other_id])
    assert text.splitlines()[0] == "failures: 3 distinct, in 4 cells"
    assert "[1] in 2 cells: ov-p1-none@minimal, ov-p4-none@minimal" in text


def test_a_failure_that_also_breaks_a_larger_groups_first_invariant_joins_it() -> None:
    rp1 = "for stale request r1: output 0->1, kv_committed_len 0->0, expected unchanged at " \
          "process_result"
    first_a = _result("ov-p1-none", "RP1", rp1 + " (op 3, cell ov-p1-none@minimal)")
    first_b = _result("ov-p4-none", "RP1", rp1 + " (op 5, cell ov-p4-none@minimal)")
    also = _result("ov-p1-v2tree-cpu-honest", "KV5",
                   "for retracted request r0: kv_committed_len=1, kv_allocated_len=0, "
                   "expected 0 and 0 at process_result (op 5, cell x)\n  also RP1 violated "
                   "for stale request r0: output 1->2, kv_committed_len 0->1, expected "
                   "unchanged at process_result")
    unrelated = _result("nov-p1-none", "KV7", "for page 3: free and owned at filter_batch"
                        "\n  also KV1 violated for request r0: kv_committed_len=2 > "
                        "kv_allocated_len=1 at filter_batch")
    text = render_failures([first_a, also, first_b, unrelated])
    assert text.splitlines()[0] == "failures: 2 distinct, in 4 cells", text
    assert ("[1] in 3 cells: ov-p1-none@minimal, ov-p1-v2tree-cpu-honest@minimal, "
            "ov-p4-none@minimal") in text
    assert "(in 1 of them the same state failed KV5 first" in text
    assert "[2] in 1 cell: nov-p1-none@minimal" in text


def test_review_of_an_sglang_tree_that_is_not_one_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["review", "--sglang-src", str(tmp_path / "missing")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "overlap-spec:" in err[0]


def test_ctrl_c_writes_the_report_so_far_marked_incomplete(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    process = subprocess.Popen(
        [sys.executable, "-m", "overlap_spec", "check", "--cells", "ov-p1-none,ov-p4-none",
         "--profile", "quick", "--no-upstream", "--no-proofs", "-j", "1", "--json", str(report),
         "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert process.stdout is not None
    for line in process.stdout:  # interrupt inside the differential tier
        if "differential" in line and line.startswith("["):
            process.send_signal(signal.SIGINT)
            break
    rest = process.stdout.read()
    assert process.wait(timeout=120) == 130, rest
    assert "Traceback" not in rest, rest
    assert "INTERRUPTED (report incomplete)" in rest
    document = json.loads(report.read_text())
    assert document["ok"] is False and document["incomplete"] is True
    assert document["interrupted"] == "differential"
    assert document["tiers"]["hypothesis"]["verdict"] == "pass"
    assert document["tiers"]["differential"]["verdict"] == "inconclusive"
    assert "mutants" not in document["tiers"]


def test_invariants_without_witness_at_a_tiny_pool_are_n_a_with_their_reason(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool of 4 tokens leaves many invariants without any witness: each is n/a with
    its reason (one line per invariant and reason, listing its cells), not a failure."""
    from functools import partial

    from overlap_spec.harness.drive import witness

    # The seeded search tries all its 800 scripts in a cell where invariants stay out of
    # reach (about 20 s of CPU here); what is tested is the report of those it leaves n/a,
    # the same after 2 x 40 (tests/test_witness.py runs the full search through `review`).
    monkeypatch.setattr(witness, "search_witnesses",
                        partial(witness.search_witnesses, scripts=40))
    code = main(["review", "--cells", "ov-p1-none,nov-p1-none", "--sizes", "kv_tokens=4",
                 "-q", "--jobs", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    block = out.split("n/a for want of a witness at these sizes (not a pass):\n", 1)[1]
    listed = [line for line in block.splitlines() if line.startswith("  ")
              and not line.startswith("      ")]
    assert listed and all(line.split()[0] in INVARIANT_IDS for line in listed), out
    assert ("no witness at these sizes: the seeded witness search on this tree (80 scripts"
            in " ".join(out.split()))  # the reasons wrap


def test_invariants_without_witness_print_one_line_each(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Witnesses that claim nothing and give no reason (a corpus that lost them) at a pool
    of 4 tokens: every invariant left unexercised is vacuous, one line per invariant
    listing its cells, and the run fails."""
    from overlap_spec.harness.drive import stateful
    from overlap_spec.harness.drive.witness import WitnessPlan

    monkeypatch.setattr(stateful, "get_plan", lambda config: WitnessPlan([], {}, "none"))
    code = main(["review", "--cells", "ov-p1-none,nov-p1-none", "--sizes", "kv_tokens=4",
                 "-q", "--jobs", "1"])
    out = capsys.readouterr().out
    assert code == 1, out
    block = out.split("no witness (vacuous, a failure):\n", 1)[1].splitlines()
    listed = [line for line in block if line.startswith("  ")]
    assert listed and all(line.split()[0] in INVARIANT_IDS for line in listed), out
    assert len({line.split()[0] for line in listed}) == len(listed), out


def test_check_takes_sizes_like_the_other_commands(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`check --sizes`: the Hypothesis and differential tiers run the cells at those sizes
    (the configuration's name says them), with the corpus's witnesses for them."""
    report_path = tmp_path / "r.json"
    code = main(["check", "--cells", "ov-p1-none", "--sizes", "chunked_prefill_size=4",
                 "--no-proofs", "--no-mutants", "--no-upstream", "-j", "1", "-q",
                 "--json", str(report_path), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "sizes chunked_prefill_size=4: the Hypothesis, differential and upstream" in out
    assert "witnesses: the committed corpus in 1 of 1 cells" in out
    report = json.loads(report_path.read_text())
    name = "ov-p1-none@minimal[chunked_prefill_size=4]"
    assert report["cells"] == [name]
    assert list(report["differential"]["cells"]) == [name]
    assert report["details"][name]["witnesses"]["source"] == (
        "corpus minimal/chunked_prefill_size=4.json")


def test_review_takes_radix_cells_by_name_and_says_which_they_are(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--cells` matches the radix cells' names too: a glob picks a release cell and its
    radix twin, which runs at the sizes the release serves it with, one more variant of its
    release cell in the budget; the report and the JSON say which cells are radix cells."""
    report_path = tmp_path / "r.json"
    code = main(["review", "--cells", "ov-p1-none,ov-p1-none-r*", "-j", "1", "-q",
                 "--json", str(report_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "radix (the release cell with its prefix cache on, at the sizes the release " \
           "serves it: chunked prefill in the 1 with the overlap scheduler) in 1 cell" in out
    assert out.splitlines()[-1].startswith(
        "OK: 2/2 cells clean (4 cell x size set runs; 1 of the 2 cells are radix cells)")
    report = json.loads(report_path.read_text())
    radix = "ov-p1-none-radix@minimal[chunked_prefill_size=4]"
    assert report["cells"][-1] == radix
    assert report["details"][radix]["radix"] is True
    assert report["details"]["ov-p1-none@minimal"]["radix"] is False
    assert report["details"][radix]["witnesses"]["source"] == (
        "corpus minimal/chunked_prefill_size=4.json")
    # The RX invariants are judged there, each with a witness, and n/a elsewhere.
    for invariant in ("RX1", "RX4", "RX5", "RX7"):
        assert report["invariants"][invariant][radix] == "pass", invariant
        assert report["invariants"][invariant]["ov-p1-none@minimal"] == "n/a", invariant
    # Review's budget (quick: 50 sequences a cell): the radix twin runs a share of it.
    assert 1 <= report["details"][radix]["runs"] < 50


def test_check_of_a_radix_cell_alone_runs_every_tier_there(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`check --cells NAME-radix`: the Hypothesis and differential tiers run it, and the
    proofs its bounded tree's BMC (proofs/bmc_radix.py)."""
    report_path = tmp_path / "r.json"
    code = main(["check", "--cells", "nov-p1-none-radix", "--profile", "quick",
                 "--no-mutants", "--no-upstream", "-j", "1", "-q",
                 "--json", str(report_path), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(report_path.read_text())
    name = "nov-p1-none-radix@minimal"
    assert report["cells"] == [name] and report["details"][name]["radix"] is True
    assert report["tiers"]["hypothesis"]["verdict"] == "pass"
    assert report["tiers"]["differential"]["verdict"] == "pass"
    assert list(report["differential"]["cells"]) == [name]
    assert report["tiers"]["proofs"]["verdict"] == "pass"
    assert report["proofs"]["bmc"]["radix"]["cells"] == ["nov-p1-none-radix"]
    assert report["proofs"]["bmc"]["proved"] >= 1


def test_the_radix_cells_need_no_flag_but_a_misspelt_one_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["review", "--cells", "ov-p1-none-radx", "-q"]) == 2
    err = capsys.readouterr().err
    assert "no cell matches 'ov-p1-none-radx'" in err and "cells --radix" in err
