"""``overlap-spec trace render``: a trace's timeline as a Mermaid sequence diagram and an SVG.

One lane per participant (the host and each stream of ``spec.happens_before``);
reads, writes, frees and event records sit on their lane; event waits, stream
waits and host synchronisations are arrows from the producer to the waiter. The
violating access (the later half of a race) is red, and a red dashed arrow joins
it to the unordered earlier access; a violation found on state, not on a race,
is a red band at its observation. The SVG is written by hand (no dependency).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from overlap_spec.harness.trace.check import TraceVerdict, check_trace
from overlap_spec.harness.trace.format import ParsedTrace, TraceEvent, read_trace
from overlap_spec.spec.happens_before import HOST, PARTICIPANTS

LANE_X0 = 330
LANE_DX = 190
ROW_DY = 22
TOP = 70


@dataclass(frozen=True)
class Row:
    """One drawn event."""

    event_id: int
    kind: str  # op | observe | access | record | arrow | violation
    lane: str | None
    text: str
    source: str | None = None  # arrow tail lane
    marker: str = ""  # access: read | write | free
    highlight: bool = False


def _op_text(raw: dict[str, Any]) -> str:
    fields = {k: v for k, v in raw.items() if k not in ("id", "event", "step", "op")}
    parts = [f"{k}={v}" for k, v in fields.items() if v not in (False, 0, [], None)
             or k in ("prompt_len", "max_new_tokens", "request")]
    return f"op {raw['step']} {raw['op']} " + " ".join(parts).replace(" ", " ")


def build_rows(parsed: ParsedTrace, verdict: TraceVerdict, window: int = 80) -> list[Row]:
    """The events to draw: all, or ``window`` events before the violation and it."""
    violation = verdict.violation
    events: list[TraceEvent] = parsed.events
    if violation is not None:
        end = next(i for i, e in enumerate(events) if e.id == violation.event_id)
        start = 0 if window <= 0 else max(0, end - window)
        events = events[start:end + 1]
    recorded_on: dict[str, str] = {}
    rows: list[Row] = []
    for event in parsed.events:
        if events and event.id >= events[0].id:
            break
        if event.event == "stream" and event.raw["kind"] == "record":
            recorded_on[event.raw["cuda_event"]] = event.raw["stream"]
    for event in events:
        raw = event.raw
        hit = violation is not None and event.id in (violation.access_event_id,
                                                     violation.earlier_event_id)
        if event.event == "op":
            rows.append(Row(event.id, "op", None, _op_text(raw)))
        elif event.event in ("observe", "call"):
            if violation is not None and event.id == violation.event_id:
                rows.append(Row(event.id, "violation", None, violation.actual, highlight=True))
            elif event.event == "call":
                rows.append(Row(event.id, "observe", HOST, f"call {raw['method']}"))
            else:
                rows.append(Row(event.id, "observe", HOST, f"observe {raw['point']}"))
        else:
            rows.append(_stream_row(event.id, raw, recorded_on, hit))
    if violation is not None and (not rows or rows[-1].kind != "violation"):
        rows.append(Row(violation.event_id, "violation", None, violation.actual, highlight=True))
    return rows


def _stream_row(event_id: int, raw: dict[str, Any], recorded_on: dict[str, str],
                hit: bool) -> Row:
    kind = raw["kind"]
    if kind in ("read", "write", "free"):
        lane = HOST if kind == "free" else raw["stream"]
        text = f"{kind} {raw['buffer']}[{raw['index']}] ({raw['operation']})"
        return Row(event_id, "access", lane, text, marker=kind, highlight=hit)
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


# ----------------------------------------------------------------------------- Mermaid
def _mermaid_text(text: str) -> str:
    # ';' ends a statement and '#' starts an entity code in Mermaid messages.
    return text.replace(";", ",").replace("#", "no. ").replace("\n", " ")


def render_mermaid(parsed: ParsedTrace, verdict: TraceVerdict, window: int = 80) -> str:
    rows = build_rows(parsed, verdict, window)
    header = parsed.header
    lines = ["sequenceDiagram",
             f"    %% overlap-spec trace: cell {header.cell}@{header.preset}, faults "
             f"{list(header.faults)}, verdict {verdict.status}"]
    lines.extend(f"    participant {p}" for p in PARTICIPANTS)
    first, last = PARTICIPANTS[0], PARTICIPANTS[-1]
    violation = verdict.violation
    for row in rows:
        label = _mermaid_text(f"[{row.event_id}] {row.text}")
        if row.kind == "op":
            lines.append(f"    Note over {first},{last}: {label}")
        elif row.kind == "violation":
            lines.append("    rect rgb(255, 200, 200)")
            lines.append(f"    Note over {first},{last}: VIOLATION {label}")
            lines.append("    end")
        elif row.kind == "arrow":
            lines.append(f"    {row.source}-->>{row.lane}: {label}")
        elif row.highlight and violation is not None \
                and row.event_id == violation.access_event_id:
            lines.append("    rect rgb(255, 200, 200)")
            lines.append(f"    {row.lane}-x{row.lane}: RACE {label}")
            lines.append("    end")
        else:
            lines.append(f"    {row.lane}->>{row.lane}: {label}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- SVG
def _lane_x(lane: str) -> int:
    return LANE_X0 + PARTICIPANTS.index(lane) * LANE_DX


def render_svg(parsed: ParsedTrace, verdict: TraceVerdict, window: int = 80) -> str:
    rows = build_rows(parsed, verdict, window)
    width = LANE_X0 + len(PARTICIPANTS) * LANE_DX + 120
    height = TOP + ROW_DY * (len(rows) + 2)
    header = parsed.header
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="11">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        'fill="#335"/></marker><marker id="race" viewBox="0 0 10 10" refX="9" refY="5" '
        'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
        '<path d="M0,0 L10,5 L0,10 z" fill="#c00"/></marker></defs>',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="18" font-size="13">{escape(header.cell)}@{escape(header.preset)} '
        f'faults={escape(",".join(header.faults) or "none")} verdict={verdict.status}'
        + (f" {escape(verdict.violation.invariant_id)}" if verdict.violation else "")
        + "</text>",
    ]
    for lane in PARTICIPANTS:
        x = _lane_x(lane)
        out.append(f'<text x="{x}" y="{TOP - 20}" text-anchor="middle" font-weight="bold">'
                   f"{escape(lane)}</text>")
        out.append(f'<line x1="{x}" y1="{TOP - 12}" x2="{x}" y2="{height - 10}" '
                   'stroke="#bbb" stroke-dasharray="4 3"/>')
    y_of: dict[int, int] = {}
    for k, row in enumerate(rows):
        y = TOP + ROW_DY * k
        y_of[row.event_id] = y
        out.append(f'<text x="8" y="{y + 4}" fill="#888">{row.event_id}</text>')
        out.extend(_svg_row(row, y, width))
    violation = verdict.violation
    if violation is not None and violation.access_event_id in y_of \
            and violation.earlier_event_id in y_of:
        later = next(r for r in rows if r.event_id == violation.access_event_id)
        earlier = next(r for r in rows if r.event_id == violation.earlier_event_id)
        assert later.lane is not None and earlier.lane is not None
        out.append(f'<line x1="{_lane_x(earlier.lane)}" y1="{y_of[earlier.event_id]}" '
                   f'x2="{_lane_x(later.lane)}" y2="{y_of[later.event_id]}" stroke="#c00" '
                   'stroke-width="1.5" stroke-dasharray="5 3" marker-end="url(#race)">'
                   f"<title>race: no happens-before edge</title></line>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _svg_row(row: Row, y: int, width: int) -> list[str]:
    text = escape(row.text)
    if row.kind == "op":
        return [f'<rect x="40" y="{y - 10}" width="{width - 50}" height="{ROW_DY - 4}" '
                'fill="#eef"/>', f'<text x="46" y="{y + 4}">{text}</text>']
    if row.kind == "violation":
        return [f'<rect x="40" y="{y - 10}" width="{width - 50}" height="{ROW_DY - 4}" '
                'fill="#fcc" stroke="#c00"/>',
                f'<text x="46" y="{y + 4}" fill="#900">VIOLATION {text}</text>']
    assert row.lane is not None
    x = _lane_x(row.lane)
    color = "#c00" if row.highlight else "#335"
    if row.kind == "arrow":
        assert row.source is not None
        x0 = _lane_x(row.source)
        if x0 == x:
            x0 -= 30
        return [f'<line x1="{x0}" y1="{y}" x2="{x}" y2="{y}" stroke="#335" '
                'marker-end="url(#arrow)"/>',
                f'<text x="{min(x0, x) + 4}" y="{y - 3}" fill="#335">{text}</text>']
    if row.kind == "observe":
        return [f'<text x="46" y="{y + 4}" fill="#999">{text}</text>']
    if row.kind == "record":
        shape = f'<rect x="{x - 4}" y="{y - 4}" width="8" height="8" fill="#585"/>'
    elif row.marker == "write":
        shape = f'<circle cx="{x}" cy="{y}" r="4.5" fill="{color}"/>'
    elif row.marker == "free":
        shape = (f'<path d="M{x - 4},{y - 4} L{x + 4},{y + 4} M{x - 4},{y + 4} '
                 f'L{x + 4},{y - 4}" stroke="{color}" stroke-width="2"/>')
    else:
        shape = f'<circle cx="{x}" cy="{y}" r="4.5" fill="white" stroke="{color}"/>'
    weight = ' font-weight="bold"' if row.highlight else ""
    return [shape, f'<text x="{x + 9}" y="{y + 4}" fill="{color}"{weight}>{text}</text>']


def render_trace_file(path: Path, out_dir: Path | None = None, window: int = 80) -> list[Path]:
    """Write ``<stem>.mmd`` and ``<stem>.svg``; returns their paths."""
    parsed = read_trace(path)
    verdict = check_trace(parsed)
    directory = out_dir or path.parent
    directory.mkdir(parents=True, exist_ok=True)
    mermaid = directory / f"{path.stem}.mmd"
    svg = directory / f"{path.stem}.svg"
    mermaid.write_text(render_mermaid(parsed, verdict, window))
    svg.write_text(render_svg(parsed, verdict, window))
    return [mermaid, svg]
