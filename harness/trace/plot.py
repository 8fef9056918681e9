"""``overlap-spec trace plot``: the lengths behind an arithmetic violation, over the run.

For a KV, SL or RP violation (a claim about lengths, not a race), one panel per request
the violation names (or, when it names none, per request of the batch or result it is
about), with its lengths at every observation point as step lines:

- KV and SL: the ScheduleBatch's ``seq_lens`` (while the request is in the batch; and
  ``seq_lens_cpu`` where it ever differs), ``kv_committed_len``, ``kv_allocated_len``
  and the ghost truth ``kv_len_true`` (what the forward really wrote);
- RP: ``output_len``, the ghost's ``output_len_true`` (what the environment emitted)
  and ``kv_committed_len``.

A violation about a batch's sum (SL1, SL3: "for the batch", "for the ... ForwardBatch")
adds a panel with ``seq_lens_sum`` against ``sum(seq_lens_cpu)``. The x axis is the
observation index, with the ops marked; the violating observation is a red line, the
series the message names carry a red marker there, and the label gives the invariant
ID and the values the spec saw.

Each picture also draws the bound the invariant compares against (``bounds.py``): KV3's
reserve ``kv_len_true + W`` at each spec decode launch, KV1's row width, KV8's settled
length plus lead, SL7's expected ``seq_lens``, RP2's ``max_new_tokens`` as series of their
own (marked at the violation); for KV4 and KV7 (ownership, not lengths) the page and
pool-row map at the violation and the observation before it, the page or row in two
places red. A line under the claim says which, or that the picture draws no bound for
that ID.

The state comes from the trace's snapshots, from a shim trace's call events (no ghost
truth: a live process has none), or, for a trace without snapshots, from re-executing
its ops on the reference (as ``trace check`` does). Written by hand as SVG, with the
canvas of ``harness/trace/svg.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from overlap_spec.harness.trace.bounds import (
    BOUND_NAMES,
    OwnershipMap,
    describe_bound,
    draw_ownership,
    get_bound,
    get_bound_value,
)
from overlap_spec.harness.trace.check import TraceVerdict, TraceViolation, check_trace
from overlap_spec.harness.trace.format import (
    INCONCLUSIVE,
    RACE_INVARIANTS,
    NotRecorded,
    ParsedTrace,
    read_trace,
)
from overlap_spec.harness.trace.record import record_script
from overlap_spec.harness.trace.svg import (
    GREY,
    INK,
    MARGIN,
    RED,
    Canvas,
    text_width,
    wrap,
)
from overlap_spec.spec.state import Observation
from overlap_spec.spec.units import RequestId

ARITHMETIC_FAMILIES = ("KV", "SL", "RP")
MAX_REQUEST_PANELS = 4
PLOT_X0 = 70  # left edge of the plotting area (y tick labels sit left of it)
PANEL_HEIGHT = 160
PANEL_GAP = 46  # between panels: the next panel's title
MIN_PLOT_WIDTH, MAX_PLOT_WIDTH, DX_PER_POINT = 640.0, 1200.0, 16.0


@dataclass(frozen=True)
class Style:
    colour: str
    width: float
    dash: str = ""


# Drawn in this order, widest first, so that equal values stay visible as nested stripes.
STYLES: dict[str, Style] = {
    "kv_allocated_len": Style("#f5a142", 7),
    "seq_lens_sum": Style("#f5a142", 7),
    "output_len": Style("#8fbbe0", 7),
    "kv_committed_len": Style("#2ca02c", 4),
    "seq_lens": Style("#1f77b4", 2),
    "sum(seq_lens_cpu)": Style("#17becf", 2),
    "seq_lens_cpu": Style("#9467bd", 1.3, "3 2"),
    "kv_len_true": Style("#000000", 1.3, "6 3"),
    "output_len_true": Style("#000000", 1.3, "6 3"),
    # The bounds (bounds.py), drawn last: on top of the lengths they bound.
    "written position + 1": Style("#f7b6d2", 7),
    "kv_len_true + W": Style("#d62728", 3, "5 2"),
    "page-aligned kv_allocated_len": Style("#8c564b", 2, "2 2"),
    "row width": Style("#d62728", 2, "8 3"),
    "settled_len + lead": Style("#d62728", 2.5, "5 2"),
    "prompt + output + k": Style("#d62728", 2.5, "5 2"),
    "max_new_tokens": Style("#d62728", 2, "8 3"),
}
STATUS_FILLS = {"finished": "#e8e8e8", "retracted": "#fde3cf"}
# Words of a violation message that name a series without its field name.
ALIASES: dict[str, tuple[str, ...]] = {
    "kv_len_true": ("true length", "true KV length"),
    "output_len": ("output ", "output_ids"),
    "output_len_true": ("emitted",),
}


class PlotError(ValueError):
    """The trace has no arithmetic violation to plot (CLI exit code 2)."""


@dataclass(frozen=True)
class Series:
    name: str
    values: tuple[int | None, ...]  # one per observation; None where not defined


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[Series, ...]
    marked: tuple[str, ...]  # series the violation names: a marker at the violating point
    status: tuple[str | None, ...] = ()  # a request's "finished" / "retracted" per index


@dataclass(frozen=True)
class LengthPlot:
    """What the picture shows; :meth:`x_of` and :meth:`y_of` are its geometry."""

    title: str
    violation: TraceViolation
    points: tuple[str, ...]  # the observation point at each index
    steps: tuple[int, ...]  # the op of each index
    panels: tuple[Panel, ...]
    violation_index: int
    source: str  # where the states come from
    left_out: int  # requests involved but not drawn
    bound: str = ""  # what the picture draws as the bound broken, or that it draws none
    # KV4, KV7: the page and pool-row map before and at the violation
    ownership: tuple[OwnershipMap, ...] = ()

    @property
    def plot_width(self) -> float:
        return min(MAX_PLOT_WIDTH, max(MIN_PLOT_WIDTH, DX_PER_POINT * len(self.points)))

    def x_of(self, index: int) -> float:
        """The x of observation ``index`` (the middle of its step)."""
        return PLOT_X0 + (index + 0.5) * self.plot_width / len(self.points)

    def get_range(self, panel: Panel) -> tuple[int, int]:
        values = [v for s in panel.series for v in s.values if v is not None]
        low, high = min([0, *values]), max([1, *values])
        return low, high + max(1, (high - low) // 8)

    def y_of(self, panel: Panel, value: int, top: float) -> float:
        """The y of ``value`` in ``panel`` drawn from ``top``."""
        low, high = self.get_range(panel)
        return top + PANEL_HEIGHT * (high - value) / (high - low)


# ----------------------------------------------------------------------------- data
def is_arithmetic(invariant_id: str) -> bool:
    return invariant_id[:2] in ARITHMETIC_FAMILIES and invariant_id not in RACE_INVARIANTS


def is_plottable(verdict: TraceVerdict) -> bool:
    return verdict.violation is not None and is_arithmetic(verdict.violation.invariant_id)


def _require_arithmetic(verdict: TraceVerdict) -> TraceViolation:
    violation = verdict.violation
    if violation is None:
        if verdict.status == INCONCLUSIVE:
            raise PlotError("the verdict is inconclusive, there is no violation to plot ("
                            + "; ".join(verdict.notes[-1:]) + ")")
        raise PlotError("the trace passes: there is no violation to plot")
    if not is_arithmetic(violation.invariant_id):
        raise PlotError(f"{violation.invariant_id} is not an arithmetic violation (the length "
                        "plot draws KV, SL and RP violations); 'overlap-spec trace render' "
                        "draws its timeline")
    return violation


def collect_observations(parsed: ParsedTrace, violation: TraceViolation
                         ) -> tuple[list[Observation], int, str]:
    """The states in order, the index of the violating one, and where they come from."""
    if violation.event_id in parsed.calls:
        ids = sorted(parsed.calls)
        return ([parsed.calls[i] for i in ids], ids.index(violation.event_id),
                "the shim's call events (a live process has no ghost truth)")
    observe_ids = [e.id for e in parsed.events if e.event == "observe"]
    if observe_ids and all(i in parsed.states for i in observe_ids):
        return ([parsed.states[i] for i in observe_ids], observe_ids.index(violation.event_id),
                "the trace's snapshots")
    rerun = record_script(replace(parsed.script, implementation="reference"), snapshots=False)
    if rerun.violation is None or violation.invariant_id not in rerun.violation.all_ids:
        raise PlotError("re-executing the ops on the reference does not reach the "
                        f"{violation.invariant_id} violation, so there are no states to plot")
    states = [obs for _, obs in rerun.recorder.observations]
    # The reference's observer records each state before checking it: the last one failed.
    return states, len(states) - 1, "re-executing the ops on the reference (no snapshots)"


def get_involved_requests(violation: TraceViolation, obs: Observation) -> list[RequestId]:
    """The requests the message names; else those of the batch or result it is about."""
    named = [RequestId(int(r)) for r in re.findall(r"\br(\d+)\b", violation.actual)]
    if not named:
        if obs.result is not None:
            named = [entry.rid for entry in obs.result.entries]
        elif obs.forward is not None and "ForwardBatch" in violation.actual:
            named = list(obs.forward.schedule_batch.rids)
        elif obs.batch is not None:
            named = list(obs.batch.rids)
        else:
            named = [r.rid for r in obs.requests]
    return list(dict.fromkeys(named))


def _request_value(obs: Observation, rid: RequestId, name: str) -> int | None:
    if name in ("seq_lens", "seq_lens_cpu"):
        batch = obs.batch
        if batch is None or rid not in batch.rids:
            return None
        values = batch.seq_lens if name == "seq_lens" else batch.seq_lens_cpu
        j = batch.rids.index(rid)
        return None if values is None or j >= len(values) else values[j]
    request = next((r for r in obs.requests if r.rid == rid), None)
    if request is None:
        return None
    try:
        if name == "kv_len_true":
            return int(request.ghost.kv_len_true)
        if name == "output_len_true":
            return int(request.ghost.output_len_true)
    except NotRecorded:
        return None
    value: int = getattr(request, name)
    return value


def _request_status(obs: Observation, rid: RequestId) -> str | None:
    request = next((r for r in obs.requests if r.rid == rid), None)
    if request is None:
        return None
    return "finished" if request.finished else "retracted" if request.is_retracted else None


def _batch_value(obs: Observation, name: str, forward: bool) -> int | None:
    source = obs.forward if forward else obs.batch
    if source is None:
        return None
    if name == "seq_lens_sum":
        return source.seq_lens_sum
    return None if source.seq_lens_cpu is None else sum(source.seq_lens_cpu)


def get_named_series(message: str, names: list[str]) -> tuple[str, ...]:
    """The series a violation message names, by field name or by its words."""
    named = [n for n in names if re.search(rf"(?<![\w(]){re.escape(n)}(?![\w)])", message)
             or any(alias in message for alias in ALIASES.get(n, ()))]
    return tuple(named)


def compute_length_plot(parsed: ParsedTrace, verdict: TraceVerdict) -> LengthPlot:
    """The plot's data; :class:`PlotError` when the trace has no arithmetic violation."""
    violation = _require_arithmetic(verdict)
    states, index, source = collect_observations(parsed, violation)
    at = states[index]
    message = violation.actual
    family_rp = violation.invariant_id.startswith("RP")
    names = ["output_len", "kv_committed_len", "output_len_true"] if family_rp else \
        ["kv_allocated_len", "kv_committed_len", "seq_lens", "seq_lens_cpu", "kv_len_true"]
    panels: list[Panel] = []
    config = parsed.script.get_config()
    bound = get_bound(violation.invariant_id)
    forward = "ForwardBatch" in message
    if forward or "for the batch" in message:
        sums = tuple(Series(name, tuple(_batch_value(obs, name, forward) for obs in states))
                     for name in ("seq_lens_sum", "sum(seq_lens_cpu)"))
        title = f"the {at.forward.purpose} ForwardBatch" if forward and at.forward else \
            "the ScheduleBatch"
        panels.append(Panel(title, sums, get_named_series(message, [s.name for s in sums])
                            or tuple(s.name for s in sums)))
    rids = get_involved_requests(violation, at)
    for rid in rids[:MAX_REQUEST_PANELS]:
        series = [Series(name, tuple(_request_value(obs, rid, name) for obs in states))
                  for name in names]
        bounds = [Series(b.name, tuple(get_bound_value(b, config, obs, rid) for obs in states))
                  for b in (bound.series if bound else ())]
        by_name = {s.name: s for s in series}
        if "seq_lens_cpu" in by_name and by_name["seq_lens_cpu"].values == \
                by_name["seq_lens"].values:
            series.remove(by_name["seq_lens_cpu"])
        present = [s for s in series if any(v is not None for v in s.values)]
        marked = get_named_series(message, [s.name for s in present])
        # About this request: mark all of it, unless the claim is about ownership (the
        # page map below draws it; the lengths are context).
        if not marked and re.search(rf"\br{rid}\b", message) and not (
                bound and bound.ownership):
            marked = tuple(s.name for s in present)
        # The bound at the violation, where the claim was checked for this request.
        drawn = [b for b in bounds if any(v is not None for v in b.values)]
        present += drawn
        marked += tuple(b.name for b in drawn if b.values[index] is not None)
        status = tuple(_request_status(obs, rid) for obs in states)
        panels.append(Panel(f"request r{rid}", tuple(present), marked, status))
    header = parsed.header
    title = (f"{header.cell}@{header.preset}  faults={','.join(header.faults) or 'none'}: "
             f"{violation.invariant_id} violated"
             + (f" for request {violation.request}" if violation.request else ""))
    ownership: tuple[OwnershipMap, ...] = ()
    bound_line = describe_bound(violation.invariant_id)
    if bound is not None and bound.ownership:
        try:
            ownership = tuple(OwnershipMap.of(states[k], k, message if k == index else "")
                              for k in (index - 1, index) if k >= 0)
        except NotRecorded:  # a shim's call without the allocator or the pages
            bound_line = (f"no bound drawn for {violation.invariant_id}: the trace does not "
                          "carry the page ownership its claim is about")
    return LengthPlot(title, violation, tuple(obs.point.value for obs in states),
                      tuple(obs.step_index for obs in states), tuple(panels), index, source,
                      max(0, len(rids) - MAX_REQUEST_PANELS), bound_line, ownership)


# ----------------------------------------------------------------------------- SVG
def render_length_plot(parsed: ParsedTrace, verdict: TraceVerdict) -> str:
    """The SVG of :func:`compute_length_plot`."""
    return draw_length_plot(compute_length_plot(parsed, verdict))


def draw_length_plot(plot: LengthPlot) -> str:
    canvas = Canvas()
    violation = plot.violation
    wrap_px = max(plot.plot_width + PLOT_X0 - MARGIN, 640)
    canvas.text(MARGIN, 20, plot.title, size=13, attrs=' font-weight="bold"')
    y = 38.0
    for line in wrap(f"claim: {violation.expected}", wrap_px):
        canvas.text(MARGIN, y, line, attrs=f' fill="{INK}"')
        y += 15
    for line in wrap(plot.bound, wrap_px) if plot.bound else ():
        colour = INK if plot.bound.startswith("bound") else RED
        canvas.text(MARGIN, y, line, attrs=f' fill="{colour}" class="bound"')
        y += 15
    states_line = (f"{len(plot.points)} observation points, from {plot.source}; ops "
                   "marked by dotted lines")
    if plot.left_out:
        states_line += f"; {plot.left_out} more involved requests not drawn"
    canvas.text(MARGIN, y, states_line, attrs=f' fill="{GREY}"')
    y += 22
    y = _legend(canvas, plot, y)
    label_top = y + 6
    label = _violation_label(plot)
    top = label_top + 15 * len(label) + 14
    x_violation = plot.x_of(plot.violation_index)
    # Right of the red line in the left half, left of it in the right half, unless the
    # label would then run off the left edge.
    widest = max(text_width(line) for line in label)
    anchor = "start" if x_violation < PLOT_X0 + plot.plot_width / 2 \
        or x_violation - 6 - widest < MARGIN else "end"
    label_x = x_violation + (6 if anchor == "start" else -6)
    for k, line in enumerate(label):
        canvas.text(label_x, label_top + 10 + 15 * k, line, anchor=anchor,
                    attrs=f' fill="{RED}"' + (' font-weight="bold"' if k == 0 else "")
                    + ' class="violation-label"')
    bottom = top + len(plot.panels) * (PANEL_HEIGHT + PANEL_GAP) - PANEL_GAP
    _op_lines(canvas, plot, top, bottom)
    canvas.add(f'<line x1="{x_violation:.1f}" y1="{label_top:.1f}" x2="{x_violation:.1f}" '
               f'y2="{bottom:.1f}" stroke="{RED}" stroke-width="1.2" class="violation-line"/>')
    for k, panel in enumerate(plot.panels):
        _panel(canvas, plot, panel, top + k * (PANEL_HEIGHT + PANEL_GAP))
    canvas.text(PLOT_X0, bottom + 38, "observation index (one step per observation point); "
                f"red: the violating observation, index {plot.violation_index}",
                attrs=f' fill="{GREY}"')
    if plot.ownership:
        draw_ownership(canvas, list(plot.ownership), float(MARGIN), bottom + 70,
                       plot.plot_width + PLOT_X0 - MARGIN)
    return canvas.to_svg()


def _violation_label(plot: LengthPlot) -> list[str]:
    violation = plot.violation
    index = plot.violation_index
    step = plot.steps[index]
    first = (f"{violation.invariant_id} at observation {index} ({plot.points[index]}"
             + (f", op {step})" if step >= 0 else ")"))
    # The message without its ID and its place, which the first line gives.
    core = violation.actual.split(" violated ", 1)[-1]
    core = re.sub(r" at [a-z_]+( \(op -?\d+, cell [^)]*\))?$", "", core)
    # The bound's values there (bounds.py), beside the values the message gives.
    at = [f"{s.name}={s.values[index]}" + (f" ({panel.title})" if len(plot.panels) > 1 else "")
          for panel in plot.panels for s in panel.series
          if s.name in BOUND_NAMES and s.values[index] is not None]
    bound = wrap("bound here: " + ", ".join(at), max(300.0, plot.plot_width * 0.7)) if at else []
    return [first, *wrap(core, max(300.0, plot.plot_width * 0.7)), *bound]


def _legend(canvas: Canvas, plot: LengthPlot, y: float) -> float:
    names = list(dict.fromkeys(s.name for p in plot.panels for s in p.series))
    states = [s for s in STATUS_FILLS if any(s in p.status for p in plot.panels)]
    x = float(MARGIN)
    for name in [*names, *states]:
        label = name + (" (ghost truth)" if name.endswith("_true") else
                        " (bound)" if name in BOUND_NAMES else "")
        if x + 40 + text_width(label) > PLOT_X0 + plot.plot_width and x > MARGIN:
            x, y = float(MARGIN), y + 18
        if name in STATUS_FILLS:
            canvas.add(f'<rect x="{x:.1f}" y="{y - 10:.1f}" width="28" height="12" '
                       f'fill="{STATUS_FILLS[name]}"/>')
        else:
            canvas.add(_segment(name, x, x + 28, y - 4))
        canvas.text(x + 34, y, label)
        x += 34 + text_width(label) + 18
    return y + 8


def _segment(name: str, x0: float, x1: float, y: float) -> str:
    style = STYLES[name]
    dash = f' stroke-dasharray="{style.dash}"' if style.dash else ""
    return (f'<line x1="{x0:.1f}" y1="{y:.1f}" x2="{x1:.1f}" y2="{y:.1f}" '
            f'stroke="{style.colour}" stroke-width="{style.width:g}"{dash}/>')


def _op_lines(canvas: Canvas, plot: LengthPlot, top: float, bottom: float) -> None:
    """A dotted line where each op starts, labelled below the last panel when there is
    room for the label."""
    last_label = -1e9
    for index, step in enumerate(plot.steps):
        if (index and step == plot.steps[index - 1]) or step < 0:  # -1: a shim's calls
            continue
        x = plot.x_of(index) - plot.plot_width / len(plot.points) / 2
        canvas.add(f'<line x1="{x:.1f}" y1="{top:.1f}" x2="{x:.1f}" y2="{bottom:.1f}" '
                   'stroke="#bbb" stroke-dasharray="1 3"/>')
        text = f"op {step}"
        if x - last_label >= text_width(text) + 8:
            canvas.text(x + 2, bottom + 16, text, attrs=f' fill="{GREY}"')
            last_label = x


def _panel(canvas: Canvas, plot: LengthPlot, panel: Panel, top: float) -> None:
    right = PLOT_X0 + plot.plot_width
    canvas.text(PLOT_X0, top - 8, panel.title, attrs=' font-weight="bold"')
    canvas.add(f'<rect x="{PLOT_X0}" y="{top:.1f}" width="{plot.plot_width:.1f}" '
               f'height="{PANEL_HEIGHT}" fill="none" stroke="#999"/>', right, top)
    if not panel.series:
        canvas.text(PLOT_X0 + 10, top + PANEL_HEIGHT / 2, "no observation holds this request",
                    attrs=f' fill="{GREY}"')
        return
    low, high = plot.get_range(panel)
    for tick in sorted({low, 0, (low + high) // 2, high}):
        y = plot.y_of(panel, tick, top)
        canvas.add(f'<line x1="{PLOT_X0 - 4}" y1="{y:.1f}" x2="{right:.1f}" y2="{y:.1f}" '
                   'stroke="#eee"/>')
        canvas.text(PLOT_X0 - 6, y + 4, str(tick), anchor="end", attrs=f' fill="{GREY}"')
    half = plot.plot_width / len(plot.points) / 2
    _status_bands(canvas, plot, panel, top, half)
    for series in sorted(panel.series, key=lambda s: list(STYLES).index(s.name)):
        canvas.add(_step_path(plot, panel, series, top, half))
    index = plot.violation_index
    for series in panel.series:
        value = series.values[index]
        if series.name not in panel.marked or value is None:
            continue
        canvas.add(f'<circle cx="{plot.x_of(index):.1f}" cy="{plot.y_of(panel, value, top):.1f}"'
                   f' r="5" fill="none" stroke="{RED}" stroke-width="2" class="violation" '
                   f'data-index="{index}" data-series="{series.name}" data-value="{value}">'
                   f"<title>{series.name}={value} at observation {index}</title></circle>")


def _status_bands(canvas: Canvas, plot: LengthPlot, panel: Panel, top: float,
                  half: float) -> None:
    """Shade the stretches where the request is finished or retracted (a stale request's
    late result is what RP1, RP3 and KV6 are about)."""
    start = 0
    for index in range(1, len(panel.status) + 1):
        if index < len(panel.status) and panel.status[index] == panel.status[start]:
            continue
        state = panel.status[start]
        if state is not None:
            x0 = plot.x_of(start) - half
            canvas.items.insert(0, f'<rect x="{x0:.1f}" y="{top:.1f}" '
                                f'width="{plot.x_of(index - 1) + half - x0:.1f}" '
                                f'height="{PANEL_HEIGHT}" fill="{STATUS_FILLS[state]}" '
                                f'class="status"><title>{state}</title></rect>')
        start = index


def _step_path(plot: LengthPlot, panel: Panel, series: Series, top: float,
               half: float) -> str:
    """The series as a step line: each value held across its observation's step; a value
    not defined (request not in the batch, not yet admitted) breaks the line."""
    parts: list[str] = []
    previous: int | None = None
    for index, value in enumerate(series.values):
        if value is None:
            previous = None
            continue
        x0, y = plot.x_of(index) - half, plot.y_of(panel, value, top)
        parts.append(f"M{x0:.1f},{y:.1f}" if previous is None else f"V{y:.1f}")
        parts.append(f"H{x0 + 2 * half:.1f}")
        previous = value
    style = STYLES[series.name]
    dash = f' stroke-dasharray="{style.dash}"' if style.dash else ""
    return (f'<path d="{" ".join(parts)}" fill="none" stroke="{style.colour}" '
            f'stroke-width="{style.width:g}"{dash} class="series" data-series="{series.name}"'
            f'><title>{series.name}</title></path>')


def plot_trace_file(path: Path, output: Path | None = None) -> Path:
    """Write the length plot of ``path``'s violation (default ``<stem>.lengths.svg`` beside
    it); :class:`PlotError` when there is none to plot."""
    parsed = read_trace(path)
    verdict = check_trace(parsed)
    svg = render_length_plot(parsed, verdict)
    target = output or path.with_name(f"{path.stem}.lengths.svg")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(svg)
    return target
