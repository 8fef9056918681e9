"""Each length plot draws the bound its invariant compares against (harness/trace/bounds.py),
or says in the picture that it draws none; review's failure block gives the invariant's
claim and the command that draws the saved trace's picture; INVARIANTS_BY_ID."""

from __future__ import annotations

import json
import re
import shlex
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
from test_trace_render import CORPUS, SVG, assert_text_inside_viewbox  # tests/ on sys.path

from overlap_spec.harness.cli import main as cli_main
from overlap_spec.harness.drive.script import Admit, Iterate, Script, load_script
from overlap_spec.harness.drive.stateful import describe_picture
from overlap_spec.harness.trace.bounds import BOUNDS, describe_bound
from overlap_spec.harness.trace.check import check_trace, record_script_trace
from overlap_spec.harness.trace.format import RACE_INVARIANTS, parse_trace, read_trace
from overlap_spec.harness.trace.plot import STYLES, compute_length_plot, draw_length_plot
from overlap_spec.spec.invariants import (
    INVARIANT_IDS,
    INVARIANTS,
    INVARIANTS_BY_ID,
    get_invariant,
)
from overlap_spec.spec.state import IterationChoices


def _texts(svg: str) -> list[str]:
    return ["".join(e.itertext()) for e in ElementTree.fromstring(svg).iter(f"{SVG}text")]


def _record(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.trace.ndjson"
    record_script_trace(load_script(CORPUS / f"{name}.json"), path)
    return path


# --------------------------------------------------------------------------- KV3: the reserve
def test_kv3_plot_draws_the_reserve_that_was_broken(tmp_path: Path) -> None:
    parsed = read_trace(_record(tmp_path, "ov-p1-v2chain-cpu-honest-minimal-B16"))
    verdict = check_trace(parsed)
    assert verdict.invariant_id == "KV3"
    plot = compute_length_plot(parsed, verdict)
    index = plot.violation_index
    (panel,) = plot.panels
    series = {s.name: s.values for s in panel.series}
    # The reserve the forward needed (true length + W) is over what was allocated there.
    reserve, allocated = series["kv_len_true + W"][index], series["kv_allocated_len"][index]
    assert reserve is not None and allocated is not None and reserve > allocated
    assert series["written position + 1"][index] == reserve == 10
    assert {"kv_len_true + W", "written position + 1"} <= set(panel.marked)
    # Drawn only where KV3 is checked: the spec decode launches.
    launches = [k for k, point in enumerate(plot.points) if point == "launch"]
    assert [k for k, v in enumerate(series["kv_len_true + W"]) if v is not None] == launches
    svg = draw_length_plot(plot)
    root = ElementTree.fromstring(svg)
    assert root.find(f".//{SVG}path[@data-series='kv_len_true + W']") is not None
    markers = {m.get("data-series"): m.get("data-value")
               for m in root.findall(f".//{SVG}circle[@class='violation']")}
    assert markers["kv_len_true + W"] == str(reserve)
    texts = _texts(svg)
    assert any(t.startswith("bound (KV3): kv_allocated_len against the reserve "
                            "kv_len_true + W") for t in texts), texts
    assert "kv_len_true + W (bound)" in texts
    assert any("bound here: kv_len_true + W=10" in t for t in texts), texts
    assert_text_inside_viewbox(svg)


# --------------------------------------------------------------------------- KV7: ownership
def _kv7_trace(tmp_path: Path) -> tuple[Path, int, int]:
    """A clean trace whose last snapshot lists a page of r1 as free too: KV7 (the page in
    two places; KV4 sees one owner and passes). Returns the path, the page and its owner."""
    clean = tmp_path / "clean.trace.ndjson"
    ops = [Admit(2, 4), Admit(1, 4), *[Iterate(IterationChoices())] * 3]
    assert record_script_trace(Script("ov-p1-none", "minimal", ops), clean).ok
    events = [json.loads(line) for line in clean.read_text().splitlines()]
    last = next(e for e in reversed(events) if e["event"] == "observe")
    owner = next(r for r in last["state"]["requests"] if r["rid"] == 1)
    page = owner["owned_pages"][0]
    allocator = last["state"]["allocator"]
    allocator["free_pages"] = [page, *allocator["free_pages"]]
    path = tmp_path / "kv7.trace.ndjson"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path, page, 1


def test_kv7_plot_marks_the_page_owned_twice(tmp_path: Path) -> None:
    path, page, rid = _kv7_trace(tmp_path)
    parsed = read_trace(path)
    verdict = check_trace(parsed)
    assert verdict.invariant_id == "KV7", verdict.describe()
    assert f"for page {page}: both free and owned by r{rid}" in verdict.violation.actual  # type: ignore[union-attr]
    plot = compute_length_plot(parsed, verdict)
    before, at = plot.ownership
    assert at.flagged_pages == {page} and not before.flagged_pages
    assert at.pages[page] == ("free", f"r{rid}") and before.pages[page] == (f"r{rid}",)
    # The lengths are right: no marker claims one of them is the broken bound.
    assert not any(p.marked for p in plot.panels)
    svg = draw_length_plot(plot)
    root = ElementTree.fromstring(svg)
    flagged = [r for r in root.iter(f"{SVG}rect") if "flagged" in r.get("class", "").split()]
    assert [(r.get("data-page"), r.get("data-places")) for r in flagged] == [
        (str(page), f"free and r{rid}")]
    texts = _texts(svg)
    assert f"page {page}: free and owned by r{rid}" in texts
    assert any(t.startswith("bound (KV7): every page free, cached or owned by one request")
               for t in texts), texts
    assert "page and pool-row ownership" in texts
    assert_text_inside_viewbox(svg)


def test_kv4_plot_marks_the_stranded_pages(tmp_path: Path) -> None:
    parsed = read_trace(_record(tmp_path, "ov-p1-v2chain-cpu-honest-rungreserve-minimal-B12"))
    verdict = check_trace(parsed)
    assert verdict.invariant_id == "KV4"
    plot = compute_length_plot(parsed, verdict)
    at = plot.ownership[-1]
    owned = [p for p, where in enumerate(at.pages) if where == ("r0",)]
    # "owns 9 pages but kv_allocated_len=7 covers 7": the two past the row's slots.
    assert len(owned) == 9 and at.stranded == set(owned[7:])
    svg = draw_length_plot(plot)
    assert 'class="page stranded"' in svg
    assert_text_inside_viewbox(svg)


# --------------------------------------------------------------------------- the rest
def test_a_plot_without_a_bound_for_its_id_says_so(tmp_path: Path) -> None:
    parsed = read_trace(_record(tmp_path, "ov-p1-none-trimmed-minimal-B10"))
    verdict = check_trace(parsed)
    assert verdict.invariant_id == "KV9" and "KV9" not in BOUNDS
    texts = _texts(draw_length_plot(compute_length_plot(parsed, verdict)))
    assert any(t.startswith("no bound drawn for KV9: ") for t in texts), texts


def test_bounds_name_arithmetic_ids_and_drawable_series() -> None:
    for invariant_id, bound in BOUNDS.items():
        assert invariant_id in INVARIANT_IDS and invariant_id not in RACE_INVARIANTS
        assert all(s.name in STYLES for s in bound.series), invariant_id
        assert describe_bound(invariant_id).startswith(f"bound ({invariant_id}): ")
    assert {"KV3", "KV4", "KV7"} <= set(BOUNDS)
    assert BOUNDS["KV7"].ownership and BOUNDS["KV4"].ownership and BOUNDS["KV3"].series


# --------------------------------------------------------------------------- review
def _run_shown_command(line: str, prefix: str) -> int:
    command = line.split(": ", 1)[1]
    argv = shlex.split(command)
    assert argv[:3] == ["overlap-spec", "trace", prefix], line
    return cli_main(argv[1:])


def test_review_failure_block_gives_the_claim_and_the_picture_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["review", "--cells", "ov-p1-v2chain-cpu-honest-rungreserve", "--faults",
                     "B12", "-j", "1", "-q", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1, out
    lines = out.splitlines()
    trace = next(line for line in lines if line.startswith("    trace: "))
    claim = lines.index("    claim: KV4 (req_to_token rows own their slots): "
                        "req_to_token[row, 0:kv_allocated_len] holds")
    assert lines[claim + 1].startswith("      slots of pages the request owns"), out
    picture = next(line for line in lines[claim:] if line.startswith("    picture"))
    path = re.search(r"trace: (\S+) ", trace).group(1)  # type: ignore[union-attr]
    assert picture == f"    picture (lengths and bound): overlap-spec trace plot {path}"
    assert lines.index(trace) < claim
    assert _run_shown_command(picture, "plot") == 0
    written = Path(path).with_name(Path(path).stem + ".lengths.svg")
    assert f"wrote {written}" in capsys.readouterr().out
    assert "page and pool-row ownership" in written.read_text()


def test_the_picture_of_a_race_is_its_timeline(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = _record(tmp_path, "ov-p1-v2chain-cpu-honest-minimal-B5")
    verdict = check_trace(parse_trace(path.read_text()))
    assert verdict.invariant_id == "FM1"
    line = describe_picture(path, verdict)
    assert line == f"picture (timeline): overlap-spec trace render {path}"
    assert _run_shown_command(line, "render") == 0
    assert path.with_name(path.stem + ".svg").exists()


# --------------------------------------------------------------------------- INVARIANTS
def test_invariants_by_id_is_the_mapping_and_invariants_the_ordered_tuple() -> None:
    assert isinstance(INVARIANTS, tuple)
    assert tuple(INVARIANTS_BY_ID) == INVARIANT_IDS == tuple(i.id for i in INVARIANTS)
    assert INVARIANTS_BY_ID["KV3"].claim == "2x reserve covers draft+verify"
    assert get_invariant("KV7") is INVARIANTS_BY_ID["KV7"]
    with pytest.raises(KeyError, match="unknown invariant 'KV99'; known: SL1, "):
        get_invariant("KV99")
