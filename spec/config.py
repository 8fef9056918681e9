"""Configuration cells: which scheduler design is being checked.

A *cell* fixes the switches that change which code paths run (overlap, paging,
speculative mode, whether attention needs the host mirror, the bonus pre-claim
era, the rung-dependent reserve proposal). A *preset* fixes the sizes (pools,
context, speculative shape). A model configuration is one cell plus one preset.

Upstream sources: ``scheduler.py`` (``enable_overlap``), ``mem_cache/allocation_sizing.py``
(``get_alloc_len_per_decode``, ``get_alloc_reserve_per_decode``; ``eagle_info_v2.py``
before 0.5.23), ``overlap_utils.py`` (``needs_cpu_seq_lens``, PR 26128), PR 23456 /
PR 28754 (bonus pre-claim on / off), PR 26354 (the decode reserve is ``2 * A`` of the
widest rung, whatever the adaptive rung). Trees (topk > 1) run on pages > 1 since PR 26972
(flashinfer, fa3 and triton, ``arg_groups/speculative_hook.py``
``_PAGE_TREE_SPEC_BACKENDS``): each branch drafts into a page-aligned region of its own, so
``A = max(ceil((page - 1 + steps) / page) * page * topk, D_tok)`` (``allocation_sizing.py``
``get_alloc_len_per_decode``). Such a cell's pool is the preset's ``paged_tree_kv_tokens``:
at the minimal preset 2A is the whole 32-token pool, and one request could not decode
alone (``docs/upstream-page-trees.md`` section 5). The page-tree cells are release cells
only (the pre-claim era ended before PR 26972 landed).

Defaults are sglang 0.5.23's. Six switches name what the release does not do:

- ``preclaim``: an era (2026-04 to 06, PR 23456 until PR 28754 removed it). Its spec
  cells also retract from the back of the batch, as spec did before PR 32023
  (2026-07-23); they keep the release's reserve (PR 26354 landed inside the era). Its
  overlap cells are also ``overshoot`` cells: the era decoded past a length finish
  (#24590, reported 2026-05-07 against the then-latest code).
- ``overshoot``: an era, the overlap loop before 0.5.23's ``enable_skip_finishing_decode``
  (``scheduler.py:2063``, ``_reqs_finishing_inflight`` ``:4444``): the running batch is
  filtered only when it decodes, and a request whose queued result finishes it by length
  is decoded once more (the overshoot tick of #24590; #18301 proposed the skip). The
  release filters the running batch at every step (``:3963``) and leaves such a request
  out of the decode, skipping the decode instead of retracting when only those
  requests' KV is missing. Besides the pre-claim era's overlap cells, one non-spec cell
  (page 1) keeps it.
- ``rung_reserve``: a proposal (the ``efschu/htsglang`` fork's task #486): reserve the
  lag bound plus ``A`` of the *current* rung instead of ``2 * A`` of the widest. It is
  at most the release's reserve, and the only setting where the reserve shrinks on an
  adaptive down-switch, which is what B12 needs. Its cells fix everything the reserve
  does not touch (page 1, the host mirror on, the honest claim).
- ``trimmed_finish``: a proposal (#35694, open: keep the finishing overshoot out of what is
  cached; #24590, closed, and its fix #24745, closed unmerged, asked the same of the
  non-spec overlap +1): cut the accepted run at the stop and ``max_new_tokens`` before
  committing it, and cache only the positions whose KV a forward wrote (prompt + output -
  1). The release commits and appends the whole accepted run (``_resolve_spec_v2_tokens``),
  hides the overrun behind ``finished_len`` and caches ``Req.owned_kv_len()``
  (``schedule_batch.py:1552``): at most prompt + the visible output, the newest token
  included (under overlap a non-spec stop leaves the next decode's claim on that token's
  slot in ``kv_committed_len``: #24590), and all of ``kv_committed_len`` for an abort (no
  ``finished_len``). Two cells carry it: the chain (overlap, page 1) and non-spec (overlap,
  page 1).
- ``cpu_ub``: a proposal (the closed PR #27979): with the host mirror off, keep
  ``seq_len_cpu_ub``, a host upper bound of ``seq_lens`` (the batch's largest
  ``kv_allocated_len``), for host code that needs one. The release keeps no host length at
  all there (``seq_lens_cpu``, ``seq_lens_sum`` None). One cell (the chain, overlap, page
  1, no mirror) carries it.
- ``early_fence``: a proposal (this model's WAR fence until 2026-11-26): record the
  read-done event after the verify's last ``req_to_token`` read, before the publish. The
  release records it after the draft-extend (``eagle_worker_v2.py:1365``,
  ``eagle_draft_extend_cuda_graph_runner.py:670``), whose attention metadata re-reads
  ``req_to_token`` after the publish; the early point is sound only for a draft-extend
  that does not. One cell (the chain, overlap, page 1, the mirror on) carries it.

Switches that do not matter in a cell take one canonical value, so no two cells
run the same code paths:

- ``needs_cpu_seq_lens`` only matters for speculative overlap (it gates the
  private D2H in ``resolve_seq_lens_cpu``); elsewhere it is True.
- ``preclaim`` only exists in speculative decoding; non-speculative decode always
  claims its one slot at prepare time and the flag is False.
"""

from __future__ import annotations

import enum
import functools
import itertools
from dataclasses import dataclass, replace
from typing import Final

from overlap_spec.spec.units import TokenCount


class SpecMode(enum.Enum):
    """Speculative decoding mode of a cell."""

    NONE = "none"
    V2_CHAIN = "v2chain"  # EAGLE/MTP spec-v2, topk == 1, draft tokens == steps + 1
    V2_TREE = "v2tree"  # spec-v2 with topk > 1 (page-aligned branch regions on pages > 1)


@dataclass(frozen=True)
class Cell:
    """One combination of the design switches."""

    overlap: bool
    page_size: int
    spec_mode: SpecMode
    needs_cpu_seq_lens: bool
    preclaim: bool
    rung_reserve: bool = False  # the proposal: lag bound + A(current rung), not 2 * A(max)
    overshoot: bool = False  # the era before the finishing-decode skip and every-step filter
    trimmed_finish: bool = False  # the proposal: cut the run before committing, cache - 1
    cpu_ub: bool = False  # the proposal: seq_len_cpu_ub without the host mirror (#27979)
    early_fence: bool = False  # the proposal: read-done before the publish, not after draft-extend
    # The radix prefix cache on (the release's default; spec/radix.py). Radix cells are the
    # release's cells with it: enumerate_radix_cells, not yet in enumerate_cells' run.
    radix: bool = False

    @property
    def skips_finishing_decode(self) -> bool:
        """The release's overlap loop: a request whose queued result finishes it by length
        is left out of the next decode. (Every cell but an ``overshoot`` one also filters
        the running batch at every step, as the release's ``get_next_batch_to_run`` does.)"""
        return self.overlap and not self.overshoot

    @property
    def is_spec(self) -> bool:
        return self.spec_mode is not SpecMode.NONE

    @property
    def mixes_spec_tails(self) -> bool:
        """Spec's mixed decode tails are modelled here (with ``mixed_chunk``): the release's
        spec cells with the CPU mirror. Without it the release's rebinding still copies the
        relay to the host, a sync those cells otherwise avoid: not modelled."""
        return self.is_spec and self.needs_cpu_seq_lens and not (
            self.preclaim or self.trimmed_finish or self.early_fence or self.rung_reserve)

    @property
    def retracts_spec_from_back(self) -> bool:
        """Spec retraction from the back of the batch: the pre-claim era predates PR 32023,
        which gave spec the non-spec policy sort."""
        return self.is_spec and self.preclaim

    @property
    def name(self) -> str:
        parts = [
            "ov" if self.overlap else "nov",
            f"p{self.page_size}",
            self.spec_mode.value,
        ]
        if self.is_spec:
            parts.append("cpu" if self.needs_cpu_seq_lens else "nocpu")
            parts.append("preclaim" if self.preclaim else "honest")
        suffixes = {"rungreserve": self.rung_reserve,
                    "overshoot": self.overshoot and not self.preclaim,  # pre-claim implies it
                    "trimmed": self.trimmed_finish,
                    "ub": self.cpu_ub,
                    "earlyfence": self.early_fence,
                    "radix": self.radix}
        return "-".join(parts + [suffix for suffix, on in suffixes.items() if on])


@dataclass(frozen=True)
class Preset:
    """Sizes. ``minimal`` is tiny and fast; ``realistic`` follows upstream defaults."""

    name: str
    max_running_requests: int  # req_to_token pool rows, not counting padding row 0
    kv_tokens: int  # token-to-KV pool size, in tokens (pages = kv_tokens // page_size)
    max_context_len: TokenCount
    max_prompt_len: TokenCount
    max_new_tokens: TokenCount
    chain_steps: int  # v2 chain: draft steps S; draft tokens = S + 1
    tree_topk: int
    tree_steps: int
    tree_draft_tokens: int
    # ``chunked_prefill_size`` (0: off). The release resolves it from the memory tier (2048
    # and up), above every prompt these presets draw, so 0 is its behaviour here; a size
    # below ``max_context_len`` chunks prompts as the release would with that setting.
    chunked_prefill_size: int = 0
    # ``enable_mixed_chunk`` (0 / 1; the release's default is off): with chunking, the running
    # decodes ride in each prefill chunk's batch (``mix_with_running``): non-spec cells, and
    # the release's spec cells with the CPU mirror (spec's mixed tails).
    mixed_chunk: int = 0
    # The pool of a cell with a tree on pages > 1 (in place of ``kv_tokens``): its
    # page-aligned A makes one decode's reserve 2A = 32 tokens at the minimal shape.
    paged_tree_kv_tokens: int = 96


MINIMAL: Final = Preset(
    name="minimal",
    max_running_requests=3,
    kv_tokens=32,
    max_context_len=TokenCount(24),
    max_prompt_len=TokenCount(5),
    max_new_tokens=TokenCount(8),
    chain_steps=3,
    tree_topk=2,
    tree_steps=2,
    tree_draft_tokens=4,
)

REALISTIC: Final = Preset(
    name="realistic",
    max_running_requests=16,
    kv_tokens=4096,
    max_context_len=TokenCount(256),
    max_prompt_len=TokenCount(64),
    max_new_tokens=TokenCount(96),
    chain_steps=3,
    tree_topk=4,
    tree_steps=3,
    tree_draft_tokens=8,
    paged_tree_kv_tokens=4096,
)

PRESETS: Final = {p.name: p for p in (MINIMAL, REALISTIC)}


@dataclass(frozen=True)
class SpecShape:
    """The speculative shape of one decode step (the adaptive controller's current rung)."""

    steps: int
    topk: int
    draft_tokens: int  # D_tok, also the verify output stride
    alloc_len_per_decode: TokenCount  # A = max(steps * topk, D_tok)

    @property
    def max_accept_len(self) -> int:
        """Largest accept_len (bonus included): a chain or tree path is at most steps+1 deep."""
        return self.steps + 1 if self.steps else 1


@dataclass(frozen=True)
class ModelConfig:
    """A cell with its sizes; every derived quantity the scheduler uses lives here."""

    cell: Cell
    preset: Preset

    @property
    def page_size(self) -> int:
        return self.cell.page_size

    @property
    def is_paged_tree(self) -> bool:
        """A tree on pages > 1: page-aligned branch regions (PR 26972), its own pool."""
        return self.cell.spec_mode is SpecMode.V2_TREE and self.cell.page_size > 1

    @property
    def kv_tokens(self) -> int:
        """The token-to-KV pool size: the preset's, or ``paged_tree_kv_tokens``."""
        return self.preset.paged_tree_kv_tokens if self.is_paged_tree else self.preset.kv_tokens

    @property
    def kv_pages(self) -> int:
        return self.kv_tokens // self.cell.page_size

    # The configured (widest) shape's fields, as get_shape() states them.
    @property
    def topk(self) -> int:
        return self.get_shape().topk

    @property
    def spec_steps(self) -> int:
        return self.get_shape().steps

    @property
    def draft_tokens(self) -> int:
        """``speculative_num_draft_tokens`` (D_tok); also the verify output stride."""
        return self.get_shape().draft_tokens

    @property
    def max_accept_len(self) -> int:
        """Largest accept_len (bonus included): a chain or tree path is at most steps+1 deep."""
        return self.get_shape().max_accept_len

    @property
    def alloc_len_per_decode(self) -> TokenCount:
        """A: positions one draft+verify may write (``get_alloc_len_per_decode``)."""
        return self.get_shape().alloc_len_per_decode

    @property
    def lag_bound(self) -> TokenCount:
        """How far kv_committed_len can lag the truth at prepare time: one in-flight verify
        of the widest rung under overlap (max_speculative_num_draft_tokens), 0 without."""
        return TokenCount(self.draft_tokens if self.cell.overlap and self.cell.is_spec else 0)

    def get_decode_reserve(self, shape: SpecShape,
                           faults: frozenset[str] = frozenset()) -> TokenCount:
        """Reserve ahead of kv_committed_len for a spec decode at ``shape``.

        The release (``get_alloc_reserve_per_decode``, PR 26354): ``2 * A`` with ``A`` of
        the widest rung, so the reserve does not move with the adaptive rung; it covers
        the lag bound (one in-flight verify of the widest rung) plus any step's writes.
        The ``rung_reserve`` proposal: lag bound + ``A`` of this rung (equal at the widest
        rung, smaller after a down-switch, and ``A`` alone without overlap). B16 (in
        ``faults``) is the formula before PR 26354: ``2 * A`` of this rung, too little
        when the in-flight verify ran a wider rung.
        """
        if "B16" in faults:
            return TokenCount(2 * shape.alloc_len_per_decode)
        if self.cell.rung_reserve:
            return TokenCount(self.lag_bound + shape.alloc_len_per_decode)
        return TokenCount(2 * self.alloc_len_per_decode)

    @property
    def row_width(self) -> TokenCount:
        """req_to_token row width: max_context_len + the headroom
        (``get_req_to_token_extra_context_len``): 4, plus D_tok with speculation, widened to
        the decode reserve 2A + page - 1 (#26972) on every page size. The release widens on
        pages > 1 only, so a page-1 tree's 2A can run past its row (finding U7): that gate is
        B23, current upstream."""
        return self.get_row_width()

    def get_row_width(self, faults: frozenset[str] = frozenset()) -> TokenCount:
        """:attr:`row_width`; B21 (in ``faults``) is #26972 reverted, the row not widened
        on pages > 1 (the release's ``SGLANG_DEBUG_REVERT_PR=26972``); B23 is the release's
        gate, the row not widened on page 1."""
        extra = 4 + (self.draft_tokens if self.cell.is_spec else 0)
        gated = "B21" if self.page_size > 1 else "B23"
        if self.cell.is_spec and gated not in faults:
            extra = max(extra, 2 * self.alloc_len_per_decode + self.page_size - 1)
        return TokenCount(self.preset.max_context_len + extra)

    @property
    def name(self) -> str:
        return f"{self.cell.name}@{self.preset.name}"

    def get_shape(self, steps: int = 0) -> SpecShape:
        """The shape at rung ``steps`` (0: the configured maximum).

        Only the chain adapts its step count (adaptive candidate steps, digest 6); the
        tree keeps its configured shape. A (``get_alloc_len_per_decode``) is
        ``max(steps * topk, D_tok)`` (digest 0.2); a tree on pages > 1 gives each branch
        the pages its steps can reach from a partial last page: ``max(ceil((page - 1 +
        steps) / page) * page * topk, D_tok)`` (PR 26972), which is the same on page 1.
        """
        preset, page = self.preset, self.page_size
        if self.cell.spec_mode is SpecMode.V2_CHAIN:
            rung = min(steps, preset.chain_steps) if steps > 0 else preset.chain_steps
            return SpecShape(rung, 1, rung + 1, TokenCount(rung + 1))
        if self.cell.spec_mode is SpecMode.NONE:
            return SpecShape(0, 1, 1, TokenCount(1))
        # A branch's region: the whole pages its steps reach from a partial last page.
        branch = (page - 1 + preset.tree_steps + page - 1) // page * page
        alloc_len = max(branch * preset.tree_topk, preset.tree_draft_tokens)
        return SpecShape(preset.tree_steps, preset.tree_topk, preset.tree_draft_tokens,
                         TokenCount(alloc_len))


# What a cell switches on that sglang 0.5.23 does not do, by its Cell switch: each an era or
# a proposal, with where it comes from (in the order get_departures lists them).
DEPARTURES: Final = {
    "preclaim": "era: the 2026-04..06 bonus pre-claim (PR 23456; PR 28754 removed it), spec "
                "retracting from the back (before PR 32023)",
    "overshoot": "era: the overshoot decode, a request its queued result finishes by length "
                 "decoded once more, the running batch filtered only when it decodes (before "
                 "0.5.23's enable_skip_finishing_decode; #24590)",
    "rung_reserve": "proposal: the rung reserve, lag bound + A of the current rung (the "
                    "efschu/htsglang fork's task #486)",
    "trimmed_finish": "proposal: the trimmed finish, the accepted run cut at the stop and "
                      "max_new_tokens before it is committed, prompt + output - 1 cached "
                      "(#35694, open; #24590 and its fix #24745, closed)",
    "cpu_ub": "proposal: seq_len_cpu_ub, a host upper bound of seq_lens kept with the host "
              "mirror off (the closed PR #27979)",
    "early_fence": "proposal: the early fence, the WAR read-done recorded after the verify's "
                   "last req_to_token read and before the publish (this model's placement "
                   "before 2026-11-26; sound only for a draft-extend that builds its attention "
                   "metadata without re-reading req_to_token, which 0.5.23's does)",
}


def get_departures(cell: Cell) -> tuple[str, ...]:
    """What this cell switches on that sglang 0.5.23 does not do (empty: the release's
    behaviour): each an era or a proposal, with where it comes from (:data:`DEPARTURES`)."""
    return tuple(text for switch, text in DEPARTURES.items() if getattr(cell, switch))


def is_valid_cell(cell: Cell) -> bool:
    """Whether a cell is a configuration upstream can run, in canonical form, that the model
    covers: none of the exclusions below holds."""
    chain_p1 = cell.spec_mode is SpecMode.V2_CHAIN and cell.page_size == 1 and not cell.preclaim
    plain_p1 = not cell.is_spec and cell.page_size == 1 and not cell.overshoot
    excluded = (
        cell.page_size < 1,
        # Trees on pages > 1 (PR 26972) came after the pre-claim era.
        cell.spec_mode is SpecMode.V2_TREE and cell.page_size != 1 and cell.preclaim,
        not cell.is_spec and cell.preclaim,
        not (cell.is_spec and cell.overlap) and not cell.needs_cpu_seq_lens,
        # The rung reserve's cells vary only what the reserve depends on.
        cell.rung_reserve and not (chain_p1 and cell.needs_cpu_seq_lens),
        cell.overshoot and not cell.overlap,  # an era of the overlap loop
        # The pre-claim era decoded past a length finish too.
        cell.overlap and cell.preclaim and not cell.overshoot,
        # Outside the pre-claim era, ov-p1-none-overshoot alone.
        cell.overshoot and not cell.preclaim and (cell.is_spec or cell.page_size != 1),
        # The trimmed finish's cells: ov-p1-none-trimmed, ov-p1-v2chain-cpu-honest-trimmed.
        cell.trimmed_finish and not (cell.overlap and cell.needs_cpu_seq_lens
                                     and not cell.rung_reserve and (chain_p1 or plain_p1)),
        # seq_len_cpu_ub's one cell: ov-p1-v2chain-nocpu-honest-ub (no host mirror already
        # rules out the rung reserve and the trimmed finish).
        cell.cpu_ub and not (chain_p1 and cell.overlap and not cell.needs_cpu_seq_lens),
        # The early fence's one cell: ov-p1-v2chain-cpu-honest-earlyfence.
        cell.early_fence and not (chain_p1 and cell.overlap and cell.needs_cpu_seq_lens
                                  and not (cell.rung_reserve or cell.trimmed_finish)),
    )
    return not any(excluded)


PAGE_SIZES: Final = (1, 4)


@functools.cache
def enumerate_cells() -> tuple[Cell, ...]:
    """Every valid cell, in a stable order (non-spec first, overlap first); computed once
    (cells are frozen, and checking the product's validity took 6 ms a call)."""
    flags = ((True, False), PAGE_SIZES, (True, False), (False, True), (False, True),
             (False, True), (False, True), (False, True), (False, True))
    cells = (Cell(overlap, page, mode, needs_cpu, *era)
             for mode, overlap, page, needs_cpu, *era in itertools.product(SpecMode, *flags))
    return tuple(cell for cell in cells if is_valid_cell(cell))


@functools.cache
def enumerate_radix_cells() -> tuple[Cell, ...]:
    """The radix cells: each release cell (no era, no proposal) with the radix cache on.
    Only the reference models them so far (docs/upstream-radix-sharing.md section 5)."""
    return tuple(replace(cell, radix=True) for cell in enumerate_cells()
                 if not get_departures(cell))


@functools.cache
def _get_cells_by_name() -> dict[str, Cell]:
    return {cell.name: cell for cell in (*enumerate_cells(), *enumerate_radix_cells())}


def get_cell(name: str) -> Cell:
    """Look a cell up by its name; raises ``KeyError`` listing the valid names."""
    cells = _get_cells_by_name()
    if name not in cells:
        raise KeyError(f"unknown cell {name!r}; valid cells: {', '.join(cells)}")
    return cells[name]
