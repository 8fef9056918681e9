"""What a length plot draws for the bound an invariant's claim compares against.

A length plot (``plot.py``) draws a request's lengths; a violation is a length on the
wrong side of something. Each arithmetic ID says here what that something is
(:data:`BOUNDS`):

- a bound series, drawn beside the lengths where the claim is checked: KV3's reserve
  ``kv_len_true + W`` at each spec decode launch (and the position a forward wrote past
  ``kv_allocated_len``, and on pages > 1 the page-aligned ``kv_allocated_len``), KV1's row
  width, KV8's settled length plus the in-flight lead, SL7's expected ``seq_lens``, RP2's
  ``max_new_tokens``;
- the lengths already drawn, when the claim compares them with each other (SL1, SL2, SL3,
  SL6, KV2, KV5);
- the page and pool-row map at the violation and the observation before it (KV4, KV7:
  ownership, not lengths): every page coloured by where it is (free, tree cache, owned by
  a request), the page or row in two places, in none, or named by the message outlined in
  red.

Any other ID gets a line in the picture saying that it draws no bound for that ID (the
lengths are context, the claim is printed above them): never a picture that looks right
with nothing marked against it. Written by hand as SVG, with the canvas of ``svg.py``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from overlap_spec.harness.trace.format import NotRecorded
from overlap_spec.harness.trace.svg import GREY, INK, RED, Canvas, text_width
from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.state import Observation, ObservationPoint, RequestView
from overlap_spec.spec.transitions import (
    compute_committed_lead,
    compute_ns_expected_seq_len,
    compute_page_align_up,
)
from overlap_spec.spec.units import RequestId

# A bound's value for one request at one observation; None where the claim is not checked.
BoundValue = Callable[[ModelConfig, Observation, RequestId], "int | None"]


@dataclass(frozen=True)
class BoundSeries:
    name: str  # the legend's name; a key of plot.STYLES
    get: BoundValue


@dataclass(frozen=True)
class Bound:
    """What the picture draws for one ID: ``text`` (one line, under the claim), bound
    series in each request panel, and whether it draws the page and pool-row map."""

    text: str
    series: tuple[BoundSeries, ...] = ()
    ownership: bool = False


def _request(obs: Observation, rid: RequestId) -> RequestView | None:
    return next((r for r in obs.requests if r.rid == rid), None)


def _kv3_reserve(config: ModelConfig, obs: Observation, rid: RequestId) -> int | None:
    """KV3's bound at a spec decode launch: the true length + W the forward writes."""
    launch = obs.launch
    if obs.point is not ObservationPoint.LAUNCH or launch is None \
            or launch.forward_mode != "decode":
        return None
    member = next((m for m in launch.members if m.rid == rid), None)
    return None if member is None else int(member.ghost_kv_len + member.write_width)


def _kv3_written(config: ModelConfig, obs: Observation, rid: RequestId) -> int | None:
    """The length a forward's write past ``kv_allocated_len`` needed (position + 1)."""
    if obs.point is not ObservationPoint.LAUNCH or obs.launch is None:
        return None
    past = [w.position + 1 for w in obs.launch.kv_write_faults
            if w.rid == rid and w.reason == "beyond kv_allocated_len"]
    return max(past) if past else None


def _kv3_page_aligned(config: ModelConfig, obs: Observation, rid: RequestId) -> int | None:
    """On pages > 1: ``kv_allocated_len`` rounded up to a page, what it must equal."""
    page = obs.allocator.page_size
    launch = obs.launch
    if page <= 1 or obs.point is not ObservationPoint.LAUNCH or launch is None \
            or launch.forward_mode != "decode":
        return None
    member = next((m for m in launch.members if m.rid == rid), None)
    return None if member is None else compute_page_align_up(member.kv_allocated_len, page)


def _kv1_row_width(config: ModelConfig, obs: Observation, rid: RequestId) -> int | None:
    """The row KV1 holds a holding request to (spec.invariants.kv._get_row_width)."""
    request = _request(obs, rid)
    if request is None or not request.holds_kv:
        return None
    return min(config.row_width, obs.allocator.row_width or config.row_width)


def _kv8_settled(config: ModelConfig, obs: Observation, rid: RequestId) -> int | None:
    """KV8 at a processed result: the settled true length + the in-flight lead."""
    request = _request(obs, rid)
    if obs.point is not ObservationPoint.PROCESS_RESULT or request is None \
            or not request.is_live or request.ghost.extend_inflight:
        return None
    return int(request.ghost.settled_len
               + compute_committed_lead(config.cell, request.ghost.inflight_steps))


def _sl7_expected(config: ModelConfig, obs: Observation, rid: RequestId) -> int | None:
    """SL7 after a non-spec prepare_for_decode: prompt + output + in-flight steps."""
    request = _request(obs, rid)
    if obs.point is not ObservationPoint.PREPARE_FOR_DECODE or obs.batch is None \
            or rid not in obs.batch.rids or request is None:
        return None
    return compute_ns_expected_seq_len(request.prompt_len, request.output_len,
                                       request.ghost.inflight_steps)


def _rp2_cap(config: ModelConfig, obs: Observation, rid: RequestId) -> int | None:
    request = _request(obs, rid)
    return None if request is None else request.max_new_tokens


OWNERSHIP_KEY = ("the page and pool-row map below: each page free, in the tree cache or "
                 "owned by a request; red: a page or row in two places, in none, or named "
                 "by the message")
BOUNDS: dict[str, Bound] = {
    "SL1": Bound("seq_lens_sum against sum(seq_lens_cpu), both drawn in the batch panel"),
    "SL2": Bound("seq_lens against seq_lens_cpu, both drawn"),
    "SL3": Bound("seq_lens_sum against sum(seq_lens_cpu), both drawn in the batch panel"),
    "SL6": Bound("seq_lens against the true KV length kv_len_true, both drawn (the "
                 "published new_seq_lens is not)"),
    "SL7": Bound("seq_lens, kv_committed_len and kv_allocated_len against prompt + output "
                 "+ k at each prepare_for_decode",
                 (BoundSeries("prompt + output + k", _sl7_expected),)),
    "KV1": Bound("kv_committed_len <= kv_allocated_len <= the row width, drawn while the "
                 "request holds KV", (BoundSeries("row width", _kv1_row_width),)),
    "KV2": Bound("kv_committed_len against kv_allocated_len, both drawn"),
    "KV3": Bound("kv_allocated_len against the reserve kv_len_true + W at each spec decode "
                 "launch (and a write's position + 1 past it; on pages > 1 the length "
                 "rounded up to a page)",
                 (BoundSeries("kv_len_true + W", _kv3_reserve),
                  BoundSeries("written position + 1", _kv3_written),
                  BoundSeries("page-aligned kv_allocated_len", _kv3_page_aligned))),
    "KV4": Bound("req_to_token's slots lie in the pages the request owns, no page has two "
                 "owners: " + OWNERSHIP_KEY, ownership=True),
    "KV5": Bound("kv_committed_len and kv_allocated_len of a retracted request against 0 "
                 "(the zero line)"),
    "KV7": Bound("every page free, cached or owned by one request, every pool row free or "
                 "held by one: " + OWNERSHIP_KEY, ownership=True),
    "KV8": Bound("kv_committed_len against the settled true length + the in-flight lead at "
                 "each processed result",
                 (BoundSeries("settled_len + lead", _kv8_settled),)),
    "RP2": Bound("output_len against the ghost's output_len_true, both drawn, and against "
                 "max_new_tokens", (BoundSeries("max_new_tokens", _rp2_cap),)),
}
BOUND_NAMES = frozenset(s.name for b in BOUNDS.values() for s in b.series)


def get_bound(invariant_id: str) -> Bound | None:
    return BOUNDS.get(invariant_id)


def describe_bound(invariant_id: str) -> str:
    """The picture's line saying what it draws as the bound, or that it draws none."""
    bound = get_bound(invariant_id)
    if bound is None:
        return (f"no bound drawn for {invariant_id}: its claim is not a length against a "
                "limit this plot draws; the lengths are context, the label gives the values "
                "the spec saw")
    return f"bound ({invariant_id}): {bound.text}"


def get_bound_value(series: BoundSeries, config: ModelConfig, obs: Observation,
                    rid: RequestId) -> int | None:
    """The bound's value, None where a trace does not carry what it needs (a shim's calls
    have no ghost truth)."""
    try:
        return series.get(config, obs, rid)
    except (NotRecorded, AttributeError):
        return None


# ----------------------------------------------------------------------------- ownership
@dataclass(frozen=True)
class OwnershipMap:
    """Where every page and pool row is at one observation."""

    title: str
    pages: tuple[tuple[str, ...], ...]  # per page id: its places ("free", "tree", "r0")
    rows: tuple[tuple[int, tuple[str, ...]], ...]  # (row id, its places), by id
    flagged_pages: frozenset[int]  # in two places, in none, or named by the message
    flagged_rows: frozenset[int]
    stranded: frozenset[int]  # owned, but no slot of the owner's row lies in it
    notes: tuple[str, ...]  # what is flagged, in words

    @staticmethod
    def of(obs: Observation, index: int, message: str = "") -> OwnershipMap:
        alloc = obs.allocator
        places: dict[int, list[str]] = {page: [] for page in range(alloc.total_pages)}
        for page in alloc.free_pages:
            places.setdefault(page, []).append("free")
        for page in alloc.tree_pages:
            places.setdefault(page, []).append("tree cache")
        stranded: set[int] = set()
        for r in obs.requests:
            for page in r.owned_pages:
                places.setdefault(page, []).append(f"r{r.rid}")
            used = {slot // max(1, alloc.page_size) for slot in r.row_slots}
            stranded |= {page for page in r.owned_pages if page not in used}
        rows: dict[int, list[str]] = {}
        for row in alloc.free_pool_rows:
            rows.setdefault(row, []).append("free")
        for r in obs.requests:
            if r.req_pool_idx is not None:
                rows.setdefault(r.req_pool_idx, []).append(f"r{r.rid}")
        named_pages = {int(p) for p in re.findall(r"\bpage (\d+)", message)}
        named_pages |= {int(s) // max(1, alloc.page_size)
                        for s in re.findall(r"\bslot (\d+)", message)}
        named_rows = {int(r) for r in re.findall(r"\bpool row (\d+)", message)}
        flagged = {p for p, where in places.items() if len(where) != 1} | named_pages
        flagged_rows = {r for r, where in rows.items() if len(where) != 1} | named_rows
        notes = [f"page {p}: " + (_say(places.get(p, []), "owned") or "in no place (leak)")
                 for p in sorted(flagged)]
        notes += [f"pool row {r}: " + (_say(rows.get(r, []), "held") or "in no place")
                  for r in sorted(flagged_rows)]
        held = len(rows)
        if held != alloc.pool_rows:
            notes.append(f"{held} pool rows accounted for of {alloc.pool_rows}")
        if stranded:
            notes.append("owned but outside its row's slots (stranded): pages "
                         + ", ".join(map(str, sorted(stranded))))
        top = max(places) + 1 if places else 0
        return OwnershipMap(
            f"observation {index} ({obs.point.value}): {alloc.total_pages} pages of "
            f"{alloc.page_size} slot{'s' * (alloc.page_size != 1)}, {alloc.pool_rows} pool rows",
            tuple(tuple(places.get(p, [])) for p in range(top)),
            tuple((r, tuple(rows[r])) for r in sorted(rows)), frozenset(flagged),
            frozenset(flagged_rows), frozenset(stranded), tuple(notes))


def _say(places: list[str], verb: str) -> str:
    """``["free", "r1"]`` as "free and owned by r1"."""
    return " and ".join(f"{verb} by {p}" if p.startswith("r") else p for p in places)


CELL, CELL_GAP, CELLS_X = 20, 2, 46  # a cell, the gap between, where the cells start
FREE_FILL, TREE_FILL, DOUBLE_FILL = "#ffffff", "#c7e9c0", "#f4a6a6"
OWNER_FILLS = ("#9ecae1", "#fdd0a2", "#dadaeb", "#fdae6b", "#a1d99b", "#bcbddc", "#fcbba1",
               "#c6dbef")


def _fill(where: tuple[str, ...]) -> str:
    if len(where) != 1:
        return DOUBLE_FILL if where else "#eeeeee"
    place = where[0]
    if place == "free":
        return FREE_FILL
    if place == "tree cache":
        return TREE_FILL
    return OWNER_FILLS[int(place[1:]) % len(OWNER_FILLS)]


def draw_ownership(canvas: Canvas, maps: list[OwnershipMap], x0: float, y: float,
                   width: float) -> float:
    """The maps, one under the other from ``y``; returns the y below the last."""
    per_line = max(8, int((width - CELLS_X) // (CELL + CELL_GAP)))
    owners = sorted({p for m in maps for where in m.pages for p in where
                     if p.startswith("r")} | {p for m in maps for _, where in m.rows
                                             for p in where if p.startswith("r")},
                    key=lambda p: int(p[1:]))
    canvas.text(x0, y, "page and pool-row ownership", attrs=' font-weight="bold"')
    y += 18
    x = x0
    for label, fill in [("free", FREE_FILL), ("tree cache", TREE_FILL),
                        *((f"owned by {o}", _fill((o,))) for o in owners),
                        ("in two places / none", DOUBLE_FILL)]:
        canvas.add(f'<rect x="{x:.1f}" y="{y - 10:.1f}" width="14" height="12" '
                   f'fill="{fill}" stroke="#999"/>')
        canvas.text(x + 18, y, label)
        x += 18 + text_width(label) + 14
    y += 8
    for m in maps:
        y += 24
        canvas.text(x0, y, m.title, attrs=f' fill="{INK}"')
        y += 8
        y = _cells(canvas, "page", [(p, where) for p, where in enumerate(m.pages)],
                   m.flagged_pages, m.stranded, x0, y, per_line)
        y = _cells(canvas, "row", list(m.rows), m.flagged_rows, frozenset(), x0, y + 6,
                   per_line)
        for note in m.notes:
            y += 15
            canvas.text(x0, y, note, attrs=f' fill="{RED}" class="ownership-note"')
        if not m.notes:
            y += 15
            canvas.text(x0, y, "every page and row in exactly one place",
                        attrs=f' fill="{GREY}"')
    return y


def _cells(canvas: Canvas, kind: str, cells: list[tuple[int, tuple[str, ...]]],
           flagged: frozenset[int], stranded: frozenset[int], x0: float, y: float,
           per_line: int) -> float:
    """One labelled run of cells (pages or pool rows), wrapped at ``per_line``."""
    canvas.text(x0, y + 14, f"{kind}s", attrs=f' fill="{GREY}"')
    left = x0 + CELLS_X
    for k, (ident, where) in enumerate(cells):
        cx = left + (k % per_line) * (CELL + CELL_GAP)
        cy = y + (k // per_line) * (CELL + CELL_GAP)
        bad = ident in flagged
        classes = kind + (" flagged" if bad else "") + (" stranded" if ident in stranded
                                                         else "")
        stroke = (f'stroke="{RED}" stroke-width="2.5"' if bad else
                  f'stroke="{RED}" stroke-width="1.5" stroke-dasharray="3 2"'
                  if ident in stranded else 'stroke="#999"')
        places = " and ".join(where) or "in no place"
        canvas.add(f'<rect x="{cx:.1f}" y="{cy:.1f}" width="{CELL}" height="{CELL}" '
                   f'fill="{_fill(where)}" {stroke} class="{classes}" data-{kind}="{ident}" '
                   f'data-places="{places}"><title>{kind} {ident}: {places}</title></rect>',
                   cx + CELL, cy + CELL)
        canvas.text(cx + CELL / 2, cy + 14, str(ident), size=8, anchor="middle",
                    attrs=f' fill="{RED if bad else INK}"')
    lines = max(1, -(-len(cells) // per_line))
    return y + lines * (CELL + CELL_GAP)
