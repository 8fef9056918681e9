"""``overlap-spec trace render``: a trace's timeline as a Mermaid sequence diagram and an SVG.

One lane per participant (the host and each stream of ``spec.happens_before``);
reads, writes, frees and event records sit on their lane; event waits, stream
waits and host synchronisations are arrows from the producer to the waiter. The
racing pair is red: a red dashed arrow runs from the earlier access to the
violating one, both labels name the other event and the race's ID, and the header
names the buffer. A violation found on state, not on a race, is a red band at its
observation (``harness/trace/plot.py`` draws its lengths).

A long trace is drawn as a window of events centred on the racing access (or on
the violation): the race partner and the violation are drawn wherever they are,
and each run of events left out is one grey row that says how many and which.

The SVG is written by hand (no dependency). Its size is computed from the text it
holds (a conservative width per character of the monospace font), so no label is
clipped; long messages are wrapped.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from overlap_spec.harness.trace.check import TraceVerdict, TraceViolation, check_trace
from overlap_spec.harness.trace.format import ParsedTrace, TraceEvent, read_trace
from overlap_spec.harness.trace.plot import is_plottable, render_length_plot
from overlap_spec.harness.trace.svg import (
    GREY,
    INK,
    MARGIN,
    RED,
    Canvas,
    arrow_marker,
    text_width,
    wrap,
)
from overlap_spec.spec.happens_before import HOST, PARTICIPANTS

LANE_DX = 190
ROW_DY = 22
LINE_DY = 15  # between the lines of a wrapped label
DEFAULT_WINDOW = 80
LONG_LIST = 12  # an op's list field longer than this is shortened in its label


@dataclass(frozen=True)
class Row:
    """One drawn line of the timeline."""

    event_id: int
    kind: str  # op | observe | access | record | arrow | violation | gap
    lane: str | None
    text: str
    source: str | None = None  # arrow tail lane
    marker: str = ""  # access: read | write | free
    highlight: bool = False
    partner: int | None = None  # a racing access: the other access's event id
    buffer: str = ""  # an access: the buffer row, as the trace names it


# ----------------------------------------------------------------------------- window
def compute_window(parsed: ParsedTrace, verdict: TraceVerdict,
                   window: int = DEFAULT_WINDOW) -> list[int]:
    """Indices into ``parsed.events`` to draw, in order.

    ``window`` events centred on the racing access (or on the violation; on the first
    event of a passing trace), shifted to fit inside the trace, plus the race partner and
    the violation wherever they are. ``window <= 0`` draws every event.
    """
    events = parsed.events
    if window <= 0 or len(events) <= window:
        return list(range(len(events)))
    index_of = {event.id: i for i, event in enumerate(events)}
    violation = verdict.violation
    keep: set[int] = set()
    centre = 0
    if violation is not None:
        focus = violation.access_event_id
        centre = index_of[focus if focus is not None else violation.event_id]
        keep.add(index_of[violation.event_id])
        if violation.earlier_event_id is not None:
            keep.add(index_of[violation.earlier_event_id])
    start = min(max(0, centre - window // 2), len(events) - window)
    keep.update(range(start, start + window))
    return sorted(keep)


def _gap_text(parsed: ParsedTrace, first: int, last: int, adjective: str = "") -> str:
    """A run of events left out, indices ``first..last`` of ``parsed.events``:
    "… 812 earlier events (ids 1–812) not drawn"."""
    count = last - first + 1
    noun = (f"{adjective} " if adjective else "") + ("event" if count == 1 else "events")
    ids = f"id {parsed.events[first].id}" if first == last else \
        f"ids {parsed.events[first].id}–{parsed.events[last].id}"
    return f"… {count:,} {noun} ({ids}) not drawn"


# ----------------------------------------------------------------------------- rows
def _short(value: Any) -> Any:
    if isinstance(value, list) and len(value) > LONG_LIST:
        shown = ", ".join(str(v) for v in value[:LONG_LIST // 2])
        return f"[{shown}, … {len(value) - LONG_LIST // 2} more]"
    return value


def _op_text(raw: dict[str, Any]) -> str:
    fields = {k: v for k, v in raw.items() if k not in ("id", "event", "step", "op")}
    parts = [f"{k}={_short(v)}" for k, v in fields.items()
             if v not in (False, 0, [], None) or k in ("prompt_len", "max_new_tokens", "request")]
    return f"op {raw['step']} {raw['op']} " + " ".join(parts)


def _actor(raw: dict[str, Any]) -> str:
    return f"host (owner {raw['owner']})" if raw["kind"] == "free" else str(raw["stream"])


def get_buffer(raw: dict[str, Any]) -> str:
    """The buffer row an access names, as the trace names it: ``req_to_token[3]``."""
    return f"{raw['buffer']}[{raw['index']}]"


def describe_race(parsed: ParsedTrace, violation: TraceViolation) -> str | None:
    """One sentence naming the race's buffer and both accesses, or None (no race)."""
    if violation.access_event_id is None:
        return None
    by_id = {event.id: event.raw for event in parsed.events}
    later = by_id[violation.access_event_id]
    text = (f"race {violation.invariant_id} on {get_buffer(later)}: {later['kind']} by "
            f"{later['operation']} on {_actor(later)} (event {violation.access_event_id})")
    if violation.earlier_event_id is not None:
        earlier = by_id[violation.earlier_event_id]
        text += (f" is unordered after {earlier['kind']} by {earlier['operation']} on "
                 f"{_actor(earlier)} (event {violation.earlier_event_id})")
    return text


def build_rows(parsed: ParsedTrace, verdict: TraceVerdict,
               window: int = DEFAULT_WINDOW) -> list[Row]:
    """The rows to draw: the window's events, one gap row per run of events left out,
    and the violation band after its event."""
    violation = verdict.violation
    drawn = compute_window(parsed, verdict, window)
    drawn_set = set(drawn)
    partners: dict[int, int] = {}
    if violation is not None and violation.access_event_id is not None \
            and violation.earlier_event_id is not None:
        partners = {violation.access_event_id: violation.earlier_event_id,
                    violation.earlier_event_id: violation.access_event_id}
    recorded_on: dict[str, str] = {}
    rows: list[Row] = []
    previous = -1
    for index, event in enumerate(parsed.events):
        if index not in drawn_set:
            if event.event == "stream" and event.raw["kind"] == "record":
                recorded_on[event.raw["cuda_event"]] = event.raw["stream"]
            continue
        if index > previous + 1:
            rows.append(Row(event.id, "gap", None, _gap_text(
                parsed, previous + 1, index - 1, "earlier" if previous < 0 else "")))
        previous = index
        rows.extend(_event_rows(event, violation, recorded_on, partners))
    if previous < len(parsed.events) - 1:
        rows.append(Row(parsed.events[-1].id, "gap", None, _gap_text(
            parsed, previous + 1, len(parsed.events) - 1, "later")))
    return rows


def _event_rows(event: TraceEvent, violation: TraceViolation | None,
                recorded_on: dict[str, str], partners: dict[int, int]) -> list[Row]:
    raw = event.raw
    anchor = violation if violation is not None and event.id == violation.event_id else None
    if event.event == "op":
        rows = [Row(event.id, "op", None, _op_text(raw))]
    elif event.event in ("observe", "call"):
        if anchor is not None:
            return [_violation_row(event.id, anchor)]
        text = f"call {raw['method']}" if event.event == "call" else f"observe {raw['point']}"
        rows = [Row(event.id, "observe", HOST, text)]
    else:
        hit = event.id in partners or (violation is not None
                                       and event.id == violation.access_event_id)
        rows = [_stream_row(event.id, raw, recorded_on, hit, partners.get(event.id))]
    if anchor is not None:  # an op (gpu_impl state) or the racing access itself
        rows.append(_violation_row(event.id, anchor))
    return rows


def _violation_row(event_id: int, violation: TraceViolation) -> Row:
    # A race found without an observation reads "unsynchronised ...": name its ID.
    text = violation.actual if violation.actual.startswith(violation.invariant_id) \
        else f"{violation.invariant_id}: {violation.actual}"
    return Row(event_id, "violation", None, text, highlight=True)


def _stream_row(event_id: int, raw: dict[str, Any], recorded_on: dict[str, str],
                hit: bool, partner: int | None) -> Row:
    kind = raw["kind"]
    if kind in ("read", "write", "free"):
        lane = HOST if kind == "free" else raw["stream"]
        text = f"{kind} {get_buffer(raw)} ({raw['operation']})"
        return Row(event_id, "access", lane, text, marker=kind, highlight=hit, partner=partner,
                   buffer=get_buffer(raw))
    if kind == "record":
        recorded_on[raw["cuda_event"]] = raw["stream"]
        return Row(event_id, "record", raw["stream"], f"record {raw['cuda_event']}")
    if kind == "wait_event":
        source = recorded_on.get(raw["cuda_event"], raw["stream"])
        return Row(event_id, "arrow", raw["stream"], f"wait_event {raw['cuda_event']}", source)
    if kind == "wait_stream":
        return Row(event_id, "arrow", raw["stream"], f"wait_stream({raw['waited']})",
                   raw["waited"])
    if kind == "synchronize_event":
        source = recorded_on.get(raw["cuda_event"], HOST)
        return Row(event_id, "arrow", HOST, f"synchronize {raw['cuda_event']}", source)
    if kind == "synchronize_stream":
        return Row(event_id, "arrow", HOST, f"synchronize {raw['stream']}", raw["stream"])
    return Row(event_id, "record", raw["stream"], "enqueue")


def _race_note(row: Row, violation: TraceViolation | None) -> str:
    if row.partner is None or violation is None:
        return ""
    word = "after" if row.event_id == violation.access_event_id else "before"
    return f"  [{violation.invariant_id} race: unordered {word} event {row.partner}]"


# ----------------------------------------------------------------------------- Mermaid
def _mermaid_text(text: str) -> str:
    # ';' ends a statement and '#' starts an entity code in Mermaid messages; '<' and '>'
    # would be read as HTML, so they become the entity codes #lt; and #gt;.
    return (text.replace(";", ",").replace("#", "no. ").replace("\n", " ")
            .replace("<", "#lt;").replace(">", "#gt;"))


def _mermaid_lines(text: str, width: int = 100) -> str:
    return "<br/>".join(_mermaid_text(line) for line in textwrap.wrap(text, width))


def render_mermaid(parsed: ParsedTrace, verdict: TraceVerdict,
                   window: int = DEFAULT_WINDOW) -> str:
    rows = build_rows(parsed, verdict, window)
    header = parsed.header
    violation = verdict.violation
    lines = ["sequenceDiagram",
             f"    %% overlap-spec trace: cell {header.cell}@{header.preset}, faults "
             f"{list(header.faults)}, verdict {verdict.status}"
             + (f" {violation.invariant_id}" if violation is not None else "")]
    race = describe_race(parsed, violation) if violation is not None else None
    if race is not None:
        lines.append(f"    %% {race}")
    lines.extend(f"    participant {p}" for p in PARTICIPANTS)
    first, last = PARTICIPANTS[0], PARTICIPANTS[-1]
    lane_of = {row.event_id: row.lane for row in rows if row.kind == "access"}
    for row in rows:
        label = _mermaid_text(f"[{row.event_id}] {row.text}")
        if row.kind == "op":
            lines.append(f"    Note over {first},{last}: {label}")
        elif row.kind == "gap":
            lines.append(f"    Note over {first},{last}: {_mermaid_text(row.text)}")
        elif row.kind == "violation":
            lines.append("    rect rgb(255, 200, 200)")
            lines.append(f"    Note over {first},{last}: VIOLATION [{row.event_id}] "
                         f"{_mermaid_lines(row.text)}")
            lines.append("    end")
        elif row.kind == "arrow":
            lines.append(f"    {row.source}-->>{row.lane}: {label}")
        elif row.partner is not None and violation is not None:
            lines.extend(_mermaid_race(row, violation, lane_of.get(row.partner), label))
        elif row.highlight:
            lines.append("    rect rgb(255, 200, 200)")
            lines.append(f"    {row.lane}-x{row.lane}: RACE {label}")
            lines.append("    end")
        else:
            lines.append(f"    {row.lane}->>{row.lane}: {label}")
    return "\n".join(lines) + "\n"


def _mermaid_race(row: Row, violation: TraceViolation, partner_lane: str | None,
                  label: str) -> list[str]:
    """One access of the racing pair; at the later one, the race arrow from its partner."""
    if row.event_id != violation.access_event_id:
        return ["    rect rgb(255, 230, 200)",
                f"    {row.lane}->>{row.lane}: {label} "
                f"(race partner of [{row.partner}], {violation.invariant_id})",
                "    end"]
    return ["    rect rgb(255, 200, 200)",
            f"    {row.lane}-x{row.lane}: RACE {label}",
            f"    {partner_lane or row.lane}--x{row.lane}: RACE {violation.invariant_id} on "
            f"{_mermaid_text(row.buffer)}: [{row.partner}] to [{row.event_id}] has no "
            "happens-before edge",
            "    end"]


# ----------------------------------------------------------------------------- SVG
@dataclass(frozen=True)
class _Layout:
    id_right: float  # right edge of the event-id column
    text_x: float  # where op, observe and band labels start
    lane_x0: float  # the host lane
    wrap_px: float  # width wrapped messages may take

    def lane_x(self, lane: str) -> float:
        return self.lane_x0 + PARTICIPANTS.index(lane) * LANE_DX


def _layout(rows: list[Row]) -> _Layout:
    digits = max((len(str(row.event_id)) for row in rows), default=1)
    id_right = MARGIN + text_width("9" * digits)
    text_x = id_right + 12
    left_labels = [text_width(row.text) for row in rows if row.kind == "observe"]
    lane_x0 = text_x + max([150.0, *left_labels]) + 30
    span = lane_x0 + (len(PARTICIPANTS) - 1) * LANE_DX + 150 - text_x
    return _Layout(id_right, text_x, lane_x0, span)


def render_svg(parsed: ParsedTrace, verdict: TraceVerdict,
               window: int = DEFAULT_WINDOW) -> str:
    rows = build_rows(parsed, verdict, window)
    layout = _layout(rows)
    canvas = Canvas()
    y = _svg_header(canvas, parsed, verdict, layout, rows)
    top = y
    for lane in PARTICIPANTS:
        canvas.text(layout.lane_x(lane), y, lane, anchor="middle", attrs=' font-weight="bold"')
    y += 24
    y_of: dict[int, float] = {}
    lane_of: dict[int, str] = {}
    for row in rows:
        height = _svg_row(canvas, row, y, layout, verdict.violation)
        if row.kind == "access":
            y_of[row.event_id], lane_of[row.event_id] = y, row.lane or HOST
        y += height
    bottom = y - ROW_DY + 10
    for lane in PARTICIPANTS:
        x = layout.lane_x(lane)
        # Lane lines go first so labels are drawn over them.
        canvas.items.insert(0, f'<line x1="{x:.1f}" y1="{top + 8:.1f}" x2="{x:.1f}" '
                               f'y2="{bottom:.1f}" stroke="#bbb" stroke-dasharray="4 3"/>')
    violation = verdict.violation
    if violation is not None and violation.access_event_id in y_of \
            and violation.earlier_event_id in y_of:
        later, earlier = violation.access_event_id, violation.earlier_event_id
        assert later is not None and earlier is not None
        canvas.add(f'<line x1="{layout.lane_x(lane_of[earlier]):.1f}" y1="{y_of[earlier]:.1f}" '
                   f'x2="{layout.lane_x(lane_of[later]):.1f}" y2="{y_of[later]:.1f}" '
                   f'stroke="{RED}" stroke-width="1.5" stroke-dasharray="5 3" '
                   f'marker-end="url(#race)" class="race"><title>'
                   f"{escape(describe_race(parsed, violation) or '')}: no happens-before "
                   "edge</title></line>")
    return canvas.to_svg(arrow_marker("arrow", INK) + arrow_marker("race", RED))


def _svg_header(canvas: Canvas, parsed: ParsedTrace, verdict: TraceVerdict, layout: _Layout,
                rows: list[Row]) -> float:
    """Title, what the violation is (the race and its buffer), what was left out, the
    legend; returns where the lane headings go."""
    header = parsed.header
    violation = verdict.violation
    title = (f"{header.cell}@{header.preset}  faults={','.join(header.faults) or 'none'}  "
             f"verdict={verdict.status}"
             + (f" {violation.invariant_id}" if violation is not None else ""))
    canvas.text(MARGIN, 20, title, size=13, attrs=' font-weight="bold"')
    y = 38.0
    notes: list[tuple[str, str]] = []
    if violation is not None:
        race = describe_race(parsed, violation)
        if race is not None:
            notes.append((race, RED))
        notes.append((f"claim: {violation.expected}", INK))
    gaps = [row for row in rows if row.kind == "gap"]
    if gaps:
        shown = sum(row.kind not in ("gap", "violation") for row in rows)
        focus = "the start"
        if violation is not None:
            focus = "the violation" if violation.access_event_id is None \
                else "the racing access"
        notes.append((f"drawn: {shown:,} of {len(parsed.events):,} events, a window around "
                      f"{focus}; grey rows say which events were left out", GREY))
    for text, colour in notes:
        for line in wrap(text, layout.wrap_px + layout.text_x - MARGIN):
            canvas.text(MARGIN, y, line, attrs=f' fill="{colour}"')
            y += LINE_DY
    y += 4
    _svg_legend(canvas, MARGIN, y)
    return y + 30


def _svg_legend(canvas: Canvas, x: float, y: float) -> None:
    for marker, label in (("write", "write"), ("read", "read"), ("free", "free"),
                          ("record", "event record")):
        canvas.add(_shape(marker, x + 4, y - 4, INK))
        canvas.text(x + 14, y, label, attrs=f' fill="{GREY}"')
        x += 14 + text_width(label) + 16
    canvas.add(f'<line x1="{x:.1f}" y1="{y - 4:.1f}" x2="{x + 26:.1f}" y2="{y - 4:.1f}" '
               f'stroke="{INK}" marker-end="url(#arrow)"/>')
    canvas.text(x + 32, y, "wait / synchronize", attrs=f' fill="{GREY}"')
    x += 32 + text_width("wait / synchronize") + 16
    canvas.add(f'<line x1="{x:.1f}" y1="{y - 4:.1f}" x2="{x + 26:.1f}" y2="{y - 4:.1f}" '
               f'stroke="{RED}" stroke-dasharray="5 3" marker-end="url(#race)"/>')
    canvas.text(x + 32, y, "race: no happens-before edge", attrs=f' fill="{GREY}"')


def _shape(marker: str, x: float, y: float, colour: str) -> str:
    if marker == "record":
        return f'<rect x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8" fill="#585"/>'
    if marker == "write":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4.5" fill="{colour}"/>'
    if marker == "free":
        return (f'<path d="M{x - 4:.1f},{y - 4:.1f} L{x + 4:.1f},{y + 4:.1f} M{x - 4:.1f},'
                f'{y + 4:.1f} L{x + 4:.1f},{y - 4:.1f}" stroke="{colour}" stroke-width="2"/>')
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4.5" fill="white" stroke="{colour}"/>'


def _band(y: float, height: float, x: float, fill: str, stroke: str = "") -> \
        Callable[[float, float], str]:
    border = f' stroke="{stroke}"' if stroke else ""

    def draw(right: float, _height: float) -> str:
        return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{right - x - MARGIN:.1f}" '
                f'height="{height:.1f}" fill="{fill}"{border}/>')
    return draw


def _svg_row(canvas: Canvas, row: Row, y: float, layout: _Layout,
             violation: TraceViolation | None) -> float:
    """Draw one row with its baseline at ``y``; returns the height it takes."""
    band_x = layout.text_x - 6
    if row.kind == "gap":
        canvas.text(layout.text_x, y + 4, row.text, attrs=f' fill="{GREY}" font-style="italic"'
                    ' class="gap"')
        return ROW_DY
    canvas.text(layout.id_right, y + 4, str(row.event_id), anchor="end",
                attrs=f' fill="{GREY}"')
    if row.kind == "op":
        canvas.add(_band(y - 10, ROW_DY - 4, band_x, "#eef"))
        canvas.text(layout.text_x, y + 4, row.text)
        return ROW_DY
    if row.kind == "violation":
        lines = wrap(f"VIOLATION {row.text}", layout.wrap_px)
        height = LINE_DY * (len(lines) - 1) + ROW_DY - 4
        canvas.add(_band(y - 10, height, band_x, "#fcc", RED))
        for k, line in enumerate(lines):
            canvas.text(layout.text_x, y + 4 + LINE_DY * k, line, attrs=' fill="#900"')
        return height + 4
    if row.kind == "observe":
        canvas.text(layout.text_x, y + 4, row.text, attrs=' fill="#999"')
        return ROW_DY
    assert row.lane is not None
    x = layout.lane_x(row.lane)
    colour = RED if row.highlight else INK
    if row.kind == "arrow":
        assert row.source is not None
        x0 = layout.lane_x(row.source)
        if x0 == x:
            x0 -= 30
        canvas.add(f'<line x1="{x0:.1f}" y1="{y:.1f}" x2="{x:.1f}" y2="{y:.1f}" '
                   f'stroke="{INK}" marker-end="url(#arrow)"/>')
        canvas.text(min(x0, x) + 4, y - 4, row.text, attrs=f' fill="{INK}"')
        return ROW_DY
    canvas.add(_shape("record" if row.kind == "record" else row.marker, x, y, colour))
    weight = ' font-weight="bold"' if row.highlight else ""
    canvas.text(x + 9, y + 4, row.text + _race_note(row, violation),
                attrs=f' fill="{colour}"{weight}')
    return ROW_DY


def render_trace_file(path: Path, out_dir: Path | None = None,
                      window: int = DEFAULT_WINDOW) -> list[Path]:
    """Write ``<stem>.mmd`` and ``<stem>.svg``, and for an arithmetic violation
    ``<stem>.lengths.svg`` (``harness/trace/plot.py``); returns their paths."""
    parsed = read_trace(path)
    verdict = check_trace(parsed)
    directory = out_dir or path.parent
    directory.mkdir(parents=True, exist_ok=True)
    mermaid = directory / f"{path.stem}.mmd"
    svg = directory / f"{path.stem}.svg"
    mermaid.write_text(render_mermaid(parsed, verdict, window))
    svg.write_text(render_svg(parsed, verdict, window))
    written = [mermaid, svg]
    if is_plottable(verdict):
        lengths = directory / f"{path.stem}.lengths.svg"
        lengths.write_text(render_length_plot(parsed, verdict))
        written.append(lengths)
    return written
