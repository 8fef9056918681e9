"""The trace pictures: the timeline (SVG and Mermaid) and the length plot of an
arithmetic violation. Geometry is checked on the SVG elements; no rasteriser needed."""

from __future__ import annotations

import dataclasses
import json
import re
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

import pytest

from overlap_spec.harness.drive.script import Admit, Iterate, Script, load_script
from overlap_spec.harness.trace.check import check_trace, record_script_trace
from overlap_spec.harness.trace.cli import main
from overlap_spec.harness.trace.format import parse_trace, read_trace, strip_snapshots
from overlap_spec.harness.trace.plot import (
    Panel,
    PlotError,
    Series,
    compute_length_plot,
    draw_length_plot,
    render_length_plot,
)
from overlap_spec.harness.trace.render import (
    build_rows,
    render_mermaid,
    render_svg,
    render_trace_file,
)
from overlap_spec.spec.state import IterationChoices

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "mutant_scripts"
PICTURES = ROOT / "docs" / "pictures"
SVG = "{http://www.w3.org/2000/svg}"
# What a glyph of the monospace font can take, independent of render.py's own estimate:
# DejaVu Sans Mono, Menlo, Courier advance 0.60 em; 0.62 em is above all of them.
GLYPH_EM = 0.62
LONG_BUFFER = "future_map.new_seq_lens_buf_with_a_deliberately_long_buffer_name"
LONG_OPERATION = "resolve_seq_lens_cpu D2H copy through a deliberately long operation name"


# --------------------------------------------------------------------------- synthetic traces
def _event(events: list[dict[str, Any]], **fields: Any) -> int:
    event_id = len(events)
    events.append({"id": event_id, "event": "stream", "step": -1, **fields})
    return event_id


def synthetic_race_trace(before: int, between: int, after: int,
                         buffer: str = "future_map.seq_lens",
                         operation: str = "resolve_seq_lens_cpu",
                         reader: str = "schedule") -> tuple[str, int, int]:
    """``before`` filler events, the forward's write of ``buffer[3]``, ``between`` filler
    events, an unordered read of it on ``reader`` (the race, FM1), ``after`` filler events.
    Filler events are single-stream writes of distinct rows: they never race. Returns the
    text and the ids of the earlier and the racing access."""
    events: list[dict[str, Any]] = [{
        "id": 0, "event": "header", "schema": "overlap-spec-trace", "version": 2,
        "cell": "ov-p1-none", "preset": "minimal", "faults": [], "seed": None,
        "implementation": "synthetic", "snapshots": False}]

    def filler(count: int) -> None:
        for _ in range(count):
            _event(events, kind="write", stream="schedule", buffer="filler",
                   index=len(events), operation="filler")

    filler(before)
    earlier = _event(events, kind="write", stream="forward", buffer=buffer, index=3,
                     operation="FutureMap.publish")
    filler(between)
    racing = _event(events, kind="read", stream=reader, buffer=buffer, index=3,
                    operation=operation)
    filler(after)
    events.append({"id": len(events), "event": "end", "events": len(events) + 1})
    return "".join(json.dumps(e) + "\n" for e in events), earlier, racing


def _svg_texts(svg: str) -> tuple[float, float, list[tuple[ElementTree.Element, str]]]:
    root = ElementTree.fromstring(svg)
    _, _, width, height = (float(v) for v in root.get("viewBox", "").split())
    texts = [(e, "".join(e.itertext())) for e in root.iter(f"{SVG}text")]
    return width, height, texts


def assert_text_inside_viewbox(svg: str) -> None:
    """Every text element, at a conservative glyph width, lies inside the viewBox."""
    root = ElementTree.fromstring(svg)
    default_size = float(root.get("font-size", "16"))
    x0, y0, width, height = (float(v) for v in root.get("viewBox", "").split())
    texts = [(e, "".join(e.itertext())) for e in root.iter(f"{SVG}text")]
    assert texts
    for element, text in texts:
        size = float(element.get("font-size", default_size))
        x, y = float(element.get("x", "0")), float(element.get("y", "0"))
        extent = len(text) * size * GLYPH_EM
        left = {"start": x, "middle": x - extent / 2, "end": x - extent}[
            element.get("text-anchor", "start")]
        assert x0 <= left and left + extent <= x0 + width, (text, left, extent, x0, width)
        assert y0 <= y - 0.8 * size and y + 0.25 * size <= y0 + height, (text, y, height)


# --------------------------------------------------------------------------- timeline
def test_labels_lie_inside_the_viewbox_for_long_names() -> None:
    text, _, _ = synthetic_race_trace(5, 5, 5, buffer=LONG_BUFFER, operation=LONG_OPERATION,
                                      reader="d2h")
    parsed = parse_trace(text)
    verdict = check_trace(parsed)
    assert verdict.invariant_id == "FM1"
    svg = render_svg(parsed, verdict)
    assert_text_inside_viewbox(svg)
    # The long label on the last lane is what made the picture wider than its lanes.
    width, _, texts = _svg_texts(svg)
    assert width > 1200 and any(LONG_OPERATION in t for _, t in texts)


def test_long_op_fields_are_shortened_and_fit(tmp_path: Path) -> None:
    lens = tuple(i % 4 + 1 for i in range(16))  # one per row of the realistic preset
    ops = [Admit(3, 5), Iterate(IterationChoices(accept_lens=lens))]
    path = tmp_path / "wide.trace.ndjson"
    record_script_trace(Script("ov-p1-v2chain-cpu-honest", "realistic", ops, ("B8",)), path)
    parsed = read_trace(path)
    svg = render_svg(parsed, check_trace(parsed), window=0)
    assert_text_inside_viewbox(svg)
    assert "more]" in svg


def test_window_is_centred_on_the_racing_access() -> None:
    text, earlier, racing = synthetic_race_trace(300, 1500, 1200)
    parsed = parse_trace(text)
    verdict = check_trace(parsed)
    assert verdict.violation is not None
    assert (verdict.violation.access_event_id, verdict.violation.earlier_event_id) == \
        (racing, earlier)
    rows = build_rows(parsed, verdict, window=40)
    drawn = [r.event_id for r in rows if r.kind not in ("gap", "violation")]
    gaps = [r.text for r in rows if r.kind == "gap"]
    # The race partner, far before the window, is drawn alone between two gaps.
    assert drawn[0] == earlier and drawn[1:] == list(range(racing - 20, racing + 20))
    assert (earlier, racing, len(parsed.events)) == (301, 1802, 3002)
    assert gaps == ["… 300 earlier events (ids 1–300) not drawn",
                    "… 1,480 events (ids 302–1781) not drawn",
                    "… 1,181 later events (ids 1822–3002) not drawn"]
    kinds = [r.kind for r in rows]
    assert kinds[kinds.index("violation") - 1] == "access"  # the band follows the race
    svg = render_svg(parsed, verdict, window=40)
    assert "… 300 earlier events (ids 1–300) not drawn" in svg
    assert "drawn: 41 of 3,002 events" in svg
    assert_text_inside_viewbox(svg)
    mermaid = render_mermaid(parsed, verdict, window=40)
    assert "    Note over host,d2h: … 1,181 later events (ids 1822–3002) not drawn" in mermaid


def test_window_shifts_inside_the_trace_and_zero_draws_all() -> None:
    text, earlier, racing = synthetic_race_trace(2, 3, 500)
    parsed = parse_trace(text)
    verdict = check_trace(parsed)
    rows = build_rows(parsed, verdict, window=40)
    drawn = [r.event_id for r in rows if r.kind not in ("gap", "violation")]
    assert drawn == list(range(1, 41)) and earlier in drawn and racing in drawn
    assert [r.kind for r in rows][-1] == "gap"
    every = build_rows(parsed, verdict, window=0)
    assert not any(r.kind == "gap" for r in every)
    assert len([r for r in every if r.kind != "violation"]) == len(parsed.events)


def test_race_buffer_is_named_in_both_pictures() -> None:
    text, earlier, racing = synthetic_race_trace(3, 4, 2)
    parsed = parse_trace(text)
    verdict = check_trace(parsed)
    svg = render_svg(parsed, verdict)
    _, _, texts = _svg_texts(svg)
    header = [t for _, t in texts if t.startswith("race FM1")]
    assert header and header[0].startswith("race FM1 on future_map.seq_lens[3]: "), header
    race_line = ElementTree.fromstring(svg).find(f".//{SVG}line[@class='race']")
    assert race_line is not None
    title = "".join(race_line.itertext())
    assert "future_map.seq_lens[3]" in title
    assert f"(event {racing})" in title and f"(event {earlier})" in title
    assert "future_map.seq_lens[3]" in render_mermaid(parsed, verdict)


# A message may hold no ';' (ends a statement) and no '#' but in the entity codes it uses.
MERMAID_MESSAGE = r"(?:[^;#\n]|#(?:lt|gt);)+"
MERMAID_STATEMENT = re.compile(
    r"^    (%%.*|participant \w+|rect rgb\(\d+, \d+, \d+\)|end|"
    rf"Note over \w+,\w+: {MERMAID_MESSAGE}|\w+(->>|-->>|-x|--x)\w+: {MERMAID_MESSAGE})$")


def test_mermaid_links_the_racing_pair() -> None:
    text, earlier, racing = synthetic_race_trace(3, 4, 2)
    parsed = parse_trace(text)
    mermaid = render_mermaid(parsed, check_trace(parsed))
    lines = mermaid.splitlines()
    assert lines[0] == "sequenceDiagram"
    for line in lines[1:]:
        assert MERMAID_STATEMENT.match(line), line
    arrow = f"    forward--xschedule: RACE FM1 on future_map.seq_lens[3]: [{earlier}] to " \
            f"[{racing}] has no happens-before edge"
    assert arrow in lines
    partner = next(line for line in lines if line.startswith(f"    forward->>forward: "
                                                             f"[{earlier}]"))
    assert f"race partner of [{racing}], FM1" in partner
    # Both accesses and the arrow sit in highlighted blocks, each closed.
    assert mermaid.count("    rect ") == mermaid.count("\n    end") == 3


def test_mermaid_escapes_what_would_break_a_statement(tmp_path: Path) -> None:
    path = tmp_path / "b16.trace.ndjson"
    record_script_trace(load_script(CORPUS / "ov-p1-v2chain-cpu-honest-minimal-B16.json"), path)
    parsed = read_trace(path)
    for line in render_mermaid(parsed, check_trace(parsed)).splitlines()[1:]:
        assert MERMAID_STATEMENT.match(line), line


# --------------------------------------------------------------------------- length plot
def _b3_trace(tmp_path: Path) -> Path:
    """KV5 for request r1 (B3: the late verify of a request retracted since committed)."""
    path = tmp_path / "b3.trace.ndjson"
    record_script_trace(load_script(CORPUS / "ov-p1-v2chain-nocpu-preclaim-minimal-B3.json"),
                        path)
    return path


def _path_points(d: str) -> list[tuple[float, float, float]]:
    """The horizontal runs (x0, x1, y) of a step path made of M, H and V commands."""
    runs: list[tuple[float, float, float]] = []
    x = y = 0.0
    for command, value in re.findall(r"([MHV])([-\d.,]+)", d):
        if command == "M":
            x, y = (float(v) for v in value.split(","))
        elif command == "V":
            y = float(value)
        else:
            runs.append((x, float(value), y))
            x = float(value)
    return runs


@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshots", "inferred"])
def test_plot_marks_the_violating_point(tmp_path: Path, snapshots: bool) -> None:
    path = _b3_trace(tmp_path)
    text = path.read_text() if snapshots else strip_snapshots(path.read_text())
    parsed = parse_trace(text)
    verdict = check_trace(parsed)
    assert verdict.violation is not None and verdict.invariant_id == "KV5"
    observe_ids = [e.id for e in parsed.events if e.event == "observe"]
    expected_index = observe_ids.index(verdict.violation.event_id)
    plot = compute_length_plot(parsed, verdict)
    assert plot.violation_index == expected_index
    assert [p.title for p in plot.panels] == ["request r1"]
    assert set(plot.panels[0].marked) == {"kv_committed_len", "kv_allocated_len"}
    svg = draw_length_plot(plot)
    root = ElementTree.fromstring(svg)
    markers = root.findall(f".//{SVG}circle[@class='violation']")
    paths = {p.get("data-series"): p.get("d", "")
             for p in root.findall(f".//{SVG}path[@class='series']")}
    assert {m.get("data-series") for m in markers} == set(plot.panels[0].marked)
    values = {"kv_committed_len": 1, "kv_allocated_len": 0}  # the message's
    for marker in markers:
        series = marker.get("data-series", "")
        cx, cy = float(marker.get("cx", "")), float(marker.get("cy", ""))
        assert marker.get("data-index") == str(expected_index)
        assert marker.get("data-value") == str(values[series])
        assert cx == pytest.approx(plot.x_of(expected_index), abs=0.06)
        # The marker sits on its series' line at the violating step.
        assert any(x0 <= cx <= x1 and y == pytest.approx(cy, abs=0.06)
                   for x0, x1, y in _path_points(paths[series])), series
    line = root.find(f".//{SVG}line[@class='violation-line']")
    assert line is not None and float(line.get("x1", "")) == pytest.approx(cx, abs=0.06)
    labels = [t for e, t in _svg_texts(svg)[2] if e.get("class") == "violation-label"]
    assert labels[0] == f"KV5 at observation {expected_index} (process_result, op 4)"
    assert "kv_committed_len=1, kv_allocated_len=0, expected 0 and 0" in " ".join(labels)
    assert_text_inside_viewbox(svg)


def test_plot_labels_fit_for_a_long_message_on_a_wide_plot(tmp_path: Path) -> None:
    parsed = read_trace(_b3_trace(tmp_path))
    plot = compute_length_plot(parsed, check_trace(parsed))
    count, index = 75, 40  # the widest plot; the violation just right of its middle
    message = "KV1 violated for request r0: kv_committed_len=74 " + "and more words " * 30
    wide = dataclasses.replace(
        plot, violation=dataclasses.replace(plot.violation, invariant_id="KV1",
                                            actual=message),
        points=("launch",) * count, steps=tuple(k // 10 for k in range(count)),
        panels=(Panel("request r0", (Series("kv_committed_len", tuple(range(count))),),
                      ("kv_committed_len",)),), violation_index=index)
    svg = draw_length_plot(wide)
    assert_text_inside_viewbox(svg)
    assert ElementTree.fromstring(svg).get("viewBox", "").startswith("0 0 ")
    marker = ElementTree.fromstring(svg).find(f".//{SVG}circle[@class='violation']")
    assert marker is not None and marker.get("data-value") == str(index)


def test_plot_of_a_batch_sum_and_a_stale_request(tmp_path: Path) -> None:
    path = tmp_path / "b7.trace.ndjson"
    record_script_trace(load_script(CORPUS / "ov-p1-v2chain-cpu-honest-minimal-B7.json"), path)
    parsed = read_trace(path)
    plot = compute_length_plot(parsed, check_trace(parsed))
    assert plot.panels[0].title == "the ScheduleBatch"
    assert plot.panels[0].marked == ("seq_lens_sum", "sum(seq_lens_cpu)")
    assert [p.title for p in plot.panels[1:]] == ["request r0"]
    parsed = read_trace(_b3_trace(tmp_path))
    plot = compute_length_plot(parsed, check_trace(parsed))
    assert plot.violation.invariant_id == "KV5"
    stale = next(p for p in plot.panels if p.title == "request r1")
    assert {s.name for s in stale.series} >= {"kv_allocated_len", "kv_committed_len"}
    assert "kv_committed_len" in stale.marked
    assert_text_inside_viewbox(draw_length_plot(plot))


def test_plot_refuses_a_trace_without_an_arithmetic_violation(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clean = tmp_path / "clean.trace.ndjson"
    ops = [Admit(2, 3), Iterate(IterationChoices())]
    record_script_trace(Script("ov-p1-none", "minimal", ops), clean)
    race = tmp_path / "race.trace.ndjson"
    race.write_text(synthetic_race_trace(2, 2, 2)[0])
    for path, reason in ((clean, "the trace passes: there is no violation to plot"),
                         (race, "FM1 is not an arithmetic violation")):
        parsed = read_trace(path)
        with pytest.raises(PlotError, match=reason):
            render_length_plot(parsed, check_trace(parsed))
        assert main(["plot", str(path), "-o", str(tmp_path / "x.svg")]) == 2
        err = capsys.readouterr().err
        assert f"{path}: cannot plot: " in err and reason in err and "Traceback" not in err
        assert not (tmp_path / "x.svg").exists()
        written = render_trace_file(path, tmp_path / "pics")
        assert [p.suffix for p in written] == [".mmd", ".svg"]
    assert main(["plot", str(tmp_path / "missing.ndjson")]) == 2


def test_plot_and_render_cli_write_the_length_plot(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _b3_trace(tmp_path)
    assert main(["plot", str(trace)]) == 0
    default = tmp_path / "b3.trace.lengths.svg"
    assert f"wrote {default}" in capsys.readouterr().out
    assert main(["render", str(trace), "--out", str(tmp_path / "pics")]) == 0
    written = (tmp_path / "pics" / "b3.trace.lengths.svg").read_text()
    assert written == default.read_text()


# --------------------------------------------------------------------------- docs/pictures
def test_docs_pictures_are_what_the_readme_commands_write(tmp_path: Path) -> None:
    """docs/pictures holds the output of the commands in docs/traces.md (moved there from the
    README, which shows the pictures)."""
    race = tmp_path / "race-fm1-b5.ndjson"
    record_script_trace(load_script(CORPUS / "ov-p1-v2chain-cpu-honest-minimal-B5.json"), race)
    assert main(["render", str(race), "--out", str(tmp_path)]) == 0
    lengths = tmp_path / "lengths-kv3-b16.ndjson"
    record_script_trace(load_script(CORPUS / "ov-p1-v2chain-cpu-honest-minimal-B16.json"),
                        lengths)
    assert main(["plot", str(lengths), "-o", str(tmp_path / "lengths-kv3-b16.svg")]) == 0
    for name in ("race-fm1-b5.svg", "race-fm1-b5.mmd", "lengths-kv3-b16.svg"):
        assert (tmp_path / name).read_text() == (PICTURES / name).read_text(), (
            f"docs/pictures/{name} is stale: rerun the commands in docs/traces.md")
    readme = (ROOT / "README.md").read_text()
    assert "docs/pictures/race-fm1-b5.svg" in readme
    assert "docs/pictures/lengths-kv3-b16.svg" in readme
    # The commands that wrote them, as the docs show them.
    commands = (ROOT / "docs" / "traces.md").read_text()
    scripts = "tests/data/mutant_scripts/ov-p1-v2chain-cpu-honest-minimal"
    for shown in (f"trace record {scripts}-B5.json -o /tmp/race-fm1-b5.ndjson",
                  "trace render /tmp/race-fm1-b5.ndjson --out docs/pictures",
                  f"trace record {scripts}-B16.json -o /tmp/lengths-kv3-b16.ndjson",
                  "trace plot /tmp/lengths-kv3-b16.ndjson -o docs/pictures/lengths-kv3-b16.svg"):
        assert f"overlap-spec {shown}" in commands, shown
