"""The trace format: record, check (with and without snapshots), malformed input, render."""

from __future__ import annotations

import json
import random
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from overlap_spec.harness.catalogue import get_bug
from overlap_spec.harness.drive.generate import generate_random_ops
from overlap_spec.harness.drive.script import Admit, Iterate, Script, load_script, run_script
from overlap_spec.harness.drive.stateful import check_cell, get_profile
from overlap_spec.harness.trace.check import check_trace, check_trace_file, record_script_trace
from overlap_spec.harness.trace.cli import main
from overlap_spec.harness.trace.format import (
    INCONCLUSIVE,
    OK,
    VIOLATION,
    TraceFormatError,
    get_trace_path,
    parse_trace,
    strip_snapshots,
)
from overlap_spec.harness.trace.render import render_trace_file
from overlap_spec.spec.config import PRESETS, ModelConfig, enumerate_cells, get_cell
from overlap_spec.spec.state import IterationChoices

CORPUS = Path(__file__).parent / "data" / "mutant_scripts"
CORPUS_FILES = sorted(CORPUS.glob("*.json"))


def _bug_of(path: Path) -> str:
    return path.stem.rsplit("-", 1)[-1]


def _b8_trace(tmp_path: Path) -> Path:
    ops = [Admit(3, 5), Admit(2, 4),
           Iterate(IterationChoices(True, 0, (1, 1, 1), frozenset())),
           Iterate(IterationChoices(True, 1, (1, 1, 1), frozenset({1})))]
    path = tmp_path / "b8.trace.ndjson"
    record_script_trace(Script("ov-p1-none", "minimal", ops, ("B8",)), path)
    return path


@pytest.mark.parametrize("cell", [c.name for c in enumerate_cells()])
def test_clean_run_traces_pass_in_every_cell(cell: str, tmp_path: Path) -> None:
    config = ModelConfig(get_cell(cell), PRESETS["minimal"])
    ops = generate_random_ops(config, random.Random(cell), 12)
    path = tmp_path / "clean.ndjson"
    verdict = record_script_trace(Script(cell, "minimal", ops), path)
    assert verdict.status == OK and verdict.observations > 10, verdict.describe()
    assert not verdict.inferred
    stripped = check_trace(parse_trace(strip_snapshots(path.read_text())))
    assert stripped.status == OK and stripped.inferred, stripped.describe()
    assert stripped.observations == verdict.observations


def test_corpus_covers_every_bug() -> None:
    # B1-B17 and, in radix cells, one script for each first invariant of the RX family.
    assert {_bug_of(p) for p in CORPUS_FILES} == {f"B{i}" for i in (*range(1, 18), 26, 27, 29,
                                                                  30, 32, 33, 34, 35)}


@pytest.mark.parametrize("script_path", CORPUS_FILES, ids=lambda p: p.stem)
def test_every_mutant_kill_trace_is_rejected_with_its_id(script_path: Path,
                                                         tmp_path: Path) -> None:
    script = load_script(script_path)
    bug = get_bug(_bug_of(script_path))
    replayed = run_script(script).violation
    assert replayed is not None
    path = tmp_path / "kill.trace.ndjson"
    verdict = record_script_trace(script, path)
    assert verdict.status == VIOLATION and verdict.violation is not None, verdict.describe()
    assert verdict.violation.invariant_id in bug.invariants or set(
        verdict.violation.all_ids) & set(bug.invariants), verdict.describe()
    assert verdict.violation.all_ids == replayed.all_ids
    # Without snapshots the checker infers the state and must reach the same verdict.
    stripped = check_trace(parse_trace(strip_snapshots(path.read_text())))
    assert stripped.inferred and stripped.violation is not None, stripped.describe()
    assert stripped.violation.all_ids == verdict.violation.all_ids
    assert stripped.violation.event_id == verdict.violation.event_id
    if verdict.violation.invariant_id in ("FM1", "ST2", "ST4"):
        assert verdict.violation.access_event_id is not None


def test_violation_report_names_event_id_request_and_values(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    path = tmp_path / "b3.ndjson"
    script = load_script(CORPUS / "ov-p1-v2chain-nocpu-preclaim-minimal-B3.json")
    record_script_trace(script, path)
    assert main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("VIOLATION")
    assert "KV5 violated for request r1" in out and "expected:" in out and "actual:" in out
    assert "preceding events:" in out and "(line " in out


def test_cli_check_pass_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = ModelConfig(get_cell("ov-p4-v2chain-nocpu-preclaim"), PRESETS["minimal"])
    ops = generate_random_ops(config, random.Random(3), 10)
    path = tmp_path / "ok.ndjson"
    record_script_trace(Script(config.cell.name, "minimal", ops), path)
    assert main(["check", str(path), "--json", str(tmp_path / "v.json")]) == 0
    assert capsys.readouterr().out.startswith("PASS")
    assert json.loads((tmp_path / "v.json").read_text())["status"] == "ok"


def test_tampered_snapshot_is_checked_not_trusted(tmp_path: Path) -> None:
    """A snapshot is judged by the spec: a committed length past allocation fails KV1."""
    path = tmp_path / "ok.ndjson"
    ops = [Admit(3, 5), Iterate(IterationChoices()), Iterate(IterationChoices())]
    record_script_trace(Script("nov-p1-none", "minimal", ops), path)
    lines = path.read_text().splitlines()
    for k, line in enumerate(lines):
        raw = json.loads(line)
        if raw.get("event") == "observe" and raw["state"]["requests"]:
            request = raw["state"]["requests"][0]
            request["kv_committed_len"] = request["kv_allocated_len"] + 5
            lines[k] = json.dumps(raw)
            break
    path.write_text("\n".join(lines) + "\n")
    verdict = check_trace_file(path)
    assert verdict.status == VIOLATION and verdict.violation is not None
    assert "KV1" in verdict.violation.all_ids


def test_inference_that_cannot_reproduce_the_trace_is_inconclusive(tmp_path: Path) -> None:
    path = tmp_path / "ok.ndjson"
    ops = [Admit(3, 5), Iterate(IterationChoices()), Iterate(IterationChoices())]
    record_script_trace(Script("ov-p1-none", "minimal", ops), path)
    text = strip_snapshots(path.read_text()).replace('"alloc_for_decode"', '"elsewhere"', 1)
    verdict = check_trace(parse_trace(text))
    assert verdict.status == INCONCLUSIVE and not verdict.ok
    assert any("does not reproduce event" in n for n in verdict.notes)


# --------------------------------------------------------------------------- malformed
def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _write(tmp_path: Path, lines: list[str], newline: bool = True) -> Path:
    path = tmp_path / "bad.ndjson"
    path.write_text("\n".join(lines) + ("\n" if newline else ""))
    return path


def _edit(line: str, **changes: object) -> str:
    raw = json.loads(line)
    for key, value in changes.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    return json.dumps(raw)


def _first(lines: list[str], **match: object) -> int:
    return next(k for k, line in enumerate(lines)
                if all(json.loads(line).get(key) == value for key, value in match.items()))


MALFORMED = {
    "bad-json": lambda ls: ls[:3] + ["{not json"] + ls[4:],
    "truncated-line": None,  # handled below: the last line cut mid-object
    "no-end-line": lambda ls: ls[:-1],
    "unknown-event": lambda ls: ls[:2] + [_edit(ls[2], event="teleport")] + ls[3:],
    "unknown-stream-kind": lambda ls: [
        _edit(x, kind="fence") if k == _first(ls, event="stream") else x
        for k, x in enumerate(ls)],
    "missing-field": lambda ls: [
        _edit(x, buffer=None) if k == _first(ls, kind="write") else x
        for k, x in enumerate(ls)],
    "wrong-type": lambda ls: [
        _edit(x, index="two") if k == _first(ls, kind="write") else x
        for k, x in enumerate(ls)],
    "out-of-order-ids": lambda ls: ls[:4] + [ls[5], ls[4]] + ls[6:],
    "duplicate-id": lambda ls: ls[:5] + [ls[4]] + ls[5:],
    "bad-schema-version": lambda ls: [_edit(ls[0], version=99)] + ls[1:],
    "unknown-cell": lambda ls: [_edit(ls[0], cell="ov-p3-warp")] + ls[1:],
    "missing-header": lambda ls: ls[1:],
    "unknown-stream": lambda ls: [
        _edit(x, stream="gpu7") if k == _first(ls, kind="write") else x
        for k, x in enumerate(ls)],
    "bad-op": lambda ls: [_edit(ls[1], prompt_len=None)] + ls[2:] if False else
    [ls[0], _edit(ls[1], prompt_len=None)] + ls[2:],
    "step-mismatch": lambda ls: [
        _edit(x, step=7) if k == _first(ls, event="stream") else x
        for k, x in enumerate(ls)],
    "bad-state-field": lambda ls: [
        _edit(x, state={**json.loads(x)["state"], "point": "nowhere"})
        if k == _first(ls, event="observe") else x for k, x in enumerate(ls)],
    "event-after-end": lambda ls: ls + [json.dumps({"id": len(ls), "event": "op"})],
    "end-count": lambda ls: ls[:-1] + [_edit(ls[-1], events=3)],
    "length-out-of-range": lambda ls: [ls[0], _edit(ls[1], prompt_len=10**9)] + ls[2:],
    "negative-length": lambda ls: [ls[0], _edit(ls[1], max_new_tokens=-1)] + ls[2:],
}


@pytest.mark.parametrize(("edit", "field", "value"), [
    ({"prompt_len": 10**9}, "prompt_len", "1000000000"),
    ({"max_new_tokens": 0}, "max_new_tokens", "0"),
])
def test_an_op_outside_the_cells_limits_is_refused_at_its_line(
        tmp_path: Path, edit: dict[str, object], field: str, value: str) -> None:
    # Range-checked like a script file: a length the cell cannot hold never runs and
    # reports nothing; the error names the line, the field, the value and the range.
    lines = _lines(_b8_trace(tmp_path))
    second_admit = _first(lines[2:], event="op") + 2
    lines[second_admit] = _edit(lines[second_admit], **edit)
    with pytest.raises(TraceFormatError) as caught:
        parse_trace("\n".join(lines) + "\n")
    assert caught.value.line == second_admit + 1 and caught.value.field == field
    assert f"is {value}; allowed 1.." in str(caught.value), caught.value


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_input_exits_2_with_line_and_field(case: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    lines = _lines(_b8_trace(tmp_path))
    if case == "truncated-line":
        text = "\n".join(lines)
        path = tmp_path / "bad.ndjson"
        path.write_text(text[: len(text) - 10])
    else:
        edit = MALFORMED[case]
        assert edit is not None
        path = _write(tmp_path, edit(lines))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "line " in err, err
    if case not in ("bad-json", "truncated-line", "no-end-line", "event-after-end"):
        assert "field '" in err, err
    if case == "truncated-line":
        assert "truncated" in err
    assert main(["render", str(path), "--out", str(tmp_path / "r")]) == 2


def test_empty_and_missing_files_exit_2(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.ndjson"
    empty.write_text("")
    assert main(["check", str(empty)]) == 2
    assert main(["check", str(tmp_path / "nope.ndjson")]) == 2
    err = capsys.readouterr().err
    assert "empty file" in err and "no such file" in err and "Traceback" not in err


# --------------------------------------------------------------------------- render, record
def test_render_writes_mermaid_and_well_formed_svg(tmp_path: Path) -> None:
    mermaid, svg = render_trace_file(_b8_trace(tmp_path), tmp_path / "out")
    text = mermaid.read_text()
    assert text.startswith("sequenceDiagram")
    for lane in ("host", "schedule", "forward", "copy", "d2h"):
        assert f"participant {lane}" in text
    assert "-->>" in text and "RACE" in text and "rect rgb(255, 200, 200)" in text
    root = ElementTree.parse(svg).getroot()
    assert root.tag.endswith("svg")
    assert any(e.get("stroke") == "#c00" for e in root.iter())  # the race arrow
    assert "ST2" in svg.read_text()


def test_record_and_strip_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = CORPUS / "ov-p1-v2chain-cpu-honest-minimal-B16.json"
    out = tmp_path / "t.ndjson"
    assert main(["record", str(script), "-o", str(out)]) == 1
    assert main(["strip", str(out), "-o", str(tmp_path / "s.ndjson")]) == 0
    assert main(["check", str(tmp_path / "s.ndjson")]) == 1
    assert "KV3 violated" in capsys.readouterr().out


def test_hypothesis_failure_is_saved_as_a_trace(tmp_path: Path) -> None:
    config = ModelConfig(get_cell("ov-p1-none"), PRESETS["minimal"])
    # Without Hypothesis's shrinker (all but 0.1 s of the 8 s this took): the failure is
    # saved, with its trace, the same way shrunk or not (check's failing path shrinks:
    # tests/test_script_cli.py::test_check_with_a_fault_fails_and_reports_fail).
    result = check_cell(config, get_profile("ci"), 1, frozenset({"B8"}), save_dir=tmp_path,
                        shrink=False)
    assert result.script_path is not None
    trace = get_trace_path(result.script_path)
    verdict = check_trace_file(trace)
    assert verdict.violation is not None
    assert verdict.violation.invariant_id == result.violation.invariant_id  # type: ignore[union-attr]


def test_a_trace_keeps_the_sizes_it_ran_with(tmp_path: Path) -> None:
    """A sized script's trace names its sizes in the header, the checker reads the trace at
    those sizes, and a header whose sizes do not fit the cell is refused with the field."""
    ops = [Admit(5, 8), Admit(5, 8),
           *[Iterate(IterationChoices(True, 0, (1, 1, 1), frozenset())) for _ in range(6)]]
    script = Script("ov-p4-none", "minimal", ops, sizes={"kv_tokens": 12})
    path = tmp_path / "sized.ndjson"
    verdict = record_script_trace(script, path)
    assert verdict.status == OK, verdict.describe()
    parsed = parse_trace(path.read_text())
    assert parsed.header.sizes == {"kv_tokens": 12}
    assert parsed.script.get_config() == script.get_config()
    assert check_trace(parsed).status == OK
    bad = path.read_text().replace('"sizes":{"kv_tokens":12}', '"sizes":{"kv_tokens":13}')
    with pytest.raises(TraceFormatError, match="whole pages of 4 tokens"):
        parse_trace(bad)
