"""The one field map from a live scheduler with upstream's names to the spec's views.

Two readers of a live scheduler use it: :mod:`upstream.adapter` (the upstream tier, sglang
0.5.23 itself) and :mod:`harness.trace.shim` (a trace of any scheduler that keeps
upstream's names: sglang, or ``reference/`` and ``gpu_impl/``, whose requests keep their KV
fields on the request rather than in ``Req.kv``). What each field is read from is written
once, here, as data (:data:`REQUEST_FIELDS`, :data:`BATCH_FIELDS`); the readers add only
what a live scheduler does not keep (releases counted by a hook, the ghost).

The reasons the tier gives for not driving a cell, or for an invariant it cannot judge on
the release, live here too (:func:`get_undrivable_reason`, :data:`NOT_JUDGED_ON_RELEASE`):
they are statements about what the release keeps.

Readers fall back where the reference's objects name a field differently (``Req.kv`` or
the request itself; a string ``forward_mode``); on 0.5.23 every name is the release's, and
``upstream.compat.NEEDS`` checks them before a session starts.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.state import AllocatorView, TreeNodeView, TreeView
from overlap_spec.spec.units import PageId, PoolRow, SlotId, TokenCount


def to_ints(value: Any) -> list[int] | None:
    """A device tensor (torch ``tolist``, the reference's ``values``) or a list, as ints."""
    if value is None:
        return None
    if hasattr(value, "tolist"):
        value = value.tolist()
    elif hasattr(value, "values") and not callable(value.values):
        value = value.values
    return [int(v) for v in value]


def get_kv(req: Any) -> Any:
    """Where a request's KV fields live: ``req.kv`` (sglang's ``ReqKvInfo``) or the request."""
    return getattr(req, "kv", req)


def get_visible_output(req: Any) -> tuple[int, ...]:
    """``output_ids_through_stop``: 0.5.23 commits a whole accepted run into ``output_ids``;
    the visible output stops at ``finished_len``."""
    visible = getattr(req, "output_ids_through_stop", None)
    return tuple(int(t) for t in (visible if visible is not None else req.output_ids))


def _get_max_new_tokens(req: Any) -> TokenCount:
    limit = getattr(req.sampling_params, "max_new_tokens", None)
    return TokenCount(int(limit) if limit is not None else sys.maxsize)


def _get_row(req: Any) -> PoolRow | None:
    row = get_kv(req).req_pool_idx
    return None if row is None else PoolRow(int(row))


def _holds_kv(req: Any) -> bool:
    kv = get_kv(req)
    return bool(getattr(kv, "holds_kv", kv.req_pool_idx is not None))


@dataclass(frozen=True)
class Field:
    """One spec field: its name in the view, where upstream keeps it, how it is read."""

    view: str
    upstream: str
    read: Callable[[Any], Any]


REQUEST_FIELDS: Final[tuple[Field, ...]] = (
    Field("prompt_len", "len(Req.origin_input_ids)",
          lambda req: TokenCount(len(req.origin_input_ids))),
    Field("output_len", "len(Req.output_ids_through_stop): the visible output "
          "(output_ids may run past finished_len)",
          lambda req: TokenCount(len(get_visible_output(req)))),
    Field("max_new_tokens", "Req.sampling_params.max_new_tokens (None: unbounded)",
          _get_max_new_tokens),
    Field("kv_committed_len", "Req.kv.kv_committed_len",
          lambda req: int(get_kv(req).kv_committed_len)),
    Field("kv_allocated_len", "Req.kv.kv_allocated_len",
          lambda req: int(get_kv(req).kv_allocated_len)),
    Field("req_pool_idx", "Req.kv.req_pool_idx", _get_row),
    Field("holds_kv", "Req.kv.holds_kv (absent: a row is held)", _holds_kv),
    Field("is_retracted", "Req.is_retracted",
          lambda req: bool(getattr(req, "is_retracted", False))),
    # A release before these counters existed reports 0; the checks that compare them read
    # the ghost, which a trace's call event does not carry.
    Field("spec_verify_ct", "Req.spec_verify_ct",
          lambda req: int(getattr(req, "spec_verify_ct", 0))),
    Field("spec_num_correct_drafts", "Req.spec_num_correct_drafts",
          lambda req: int(getattr(req, "spec_num_correct_drafts", 0))),
    Field("prefix_len", "Req.prefix_len (chunked prefill)",
          lambda req: int(getattr(req, "prefix_len", 0) or 0)),
    Field("extend_end", "Req.extend_end (None: 0)",
          lambda req: int(getattr(req, "extend_end", 0) or 0)),
    Field("inflight_middle_chunks", "Req.inflight_middle_chunks",
          lambda req: int(getattr(req, "inflight_middle_chunks", 0) or 0)),
)
"""Read from the request alone. ``finished`` and ``finish_reason`` are the readers': an
abort of a waiting request leaves the scheduler with no finish reason, which only the
calls around it show."""

TOKEN_FIELDS: Final[tuple[Field, ...]] = (
    Field("output_ids", "Req.output_ids_through_stop", get_visible_output),
    Field("last_prompt_token", "Req.origin_input_ids[-1]",
          lambda req: int(req.origin_input_ids[-1])),
)
"""Token values: read when the forward is the project's stand-in, whose tokens are the
environment's (RP7); a real model's are not."""


def read_request(req: Any, *, tokens: bool) -> dict[str, Any]:
    """The :class:`~spec.state.RequestView` fields a live request holds, by view name."""
    fields = REQUEST_FIELDS + (TOKEN_FIELDS if tokens else ())
    return {f.view: f.read(req) for f in fields}


def read_row_slots(sched: Any, req: Any) -> list[int]:
    """``req_to_token[row, 0:kv_allocated_len]``: the slots the request's row reaches."""
    kv = get_kv(req)
    if kv.req_pool_idx is None:
        return []
    allocated = max(int(kv.kv_allocated_len), 0)
    table = sched.req_to_token_pool.req_to_token
    return to_ints(table[int(kv.req_pool_idx), :allocated]) or []


def read_placement(sched: Any, req: Any, page_size: int, own_from: int = 0) -> dict[str, Any]:
    """What the scheduler's queues and pools say of a request: ``waiting`` (in
    ``waiting_queue``), ``row_slots`` and ``owned_pages`` (the pages of those slots from
    ``own_from`` on, a radix cell's ``cache_protected_len``: upstream keeps no owner table;
    a page no row reaches and no free list holds is a KV7 leak)."""
    slots = read_row_slots(sched, req)
    return {"waiting": any(r is req for r in sched.waiting_queue),
            "row_slots": tuple(SlotId(s) for s in slots),
            "owned_pages": tuple(dict.fromkeys(PageId(s // page_size)
                                               for s in slots[own_from:]))}


def read_forward_mode(batch: Any, in_forward: bool = False) -> str:
    """The spec's mode name. sglang's ``ForwardMode``: ``in_forward``, a spec decode's
    relabelling (``TARGET_VERIFY``, ``DRAFT_EXTEND_V2``) reads as the decode it is; elsewhere
    those modes read as what they are (so an isolation that fails to restore ``DECODE``
    shows at ``run_batch``, SL9). The reference's and gpu_impl's modes are their names."""
    mode = getattr(batch, "forward_mode", None)
    if mode is None:
        return "idle"
    if not hasattr(mode, "is_mixed"):
        return str(getattr(mode, "name", mode)).lower()
    if in_forward and (mode.is_target_verify() or mode.is_draft_extend_v2()):
        return "decode"
    return ("mixed" if mode.is_mixed() else "extend" if mode.is_extend() else
            "decode" if mode.is_decode() else "idle")


def _get_future_indices(batch: Any) -> tuple[PoolRow, ...] | None:
    spec_info = getattr(batch, "spec_info", None)
    future = (getattr(spec_info, "future_indices", None) if spec_info is not None
              else getattr(batch, "future_indices", None))
    return None if future is None else tuple(PoolRow(v) for v in to_ints(future) or [])


def _get_cpu_indices(batch: Any) -> tuple[PoolRow, ...]:
    cpu = getattr(batch, "req_pool_indices_cpu", None)
    return tuple(PoolRow(v) for v in to_ints(cpu if cpu is not None
                                              else batch.req_pool_indices) or [])


def _get_optional_ints(value: Any) -> tuple[int, ...] | None:
    ints = to_ints(value)
    return None if ints is None else tuple(ints)


BATCH_FIELDS: Final[tuple[Field, ...]] = (
    Field("seq_lens", "ScheduleBatch.seq_lens",
          lambda batch: tuple(to_ints(batch.seq_lens) or [])),
    Field("seq_lens_cpu", "ScheduleBatch.seq_lens_cpu (None: no host mirror)",
          lambda batch: _get_optional_ints(batch.seq_lens_cpu)),
    Field("seq_lens_sum", "ScheduleBatch.seq_lens_sum (None: not computed yet)",
          lambda batch: None if batch.seq_lens_sum is None else int(batch.seq_lens_sum)),
    Field("req_pool_indices", "ScheduleBatch.req_pool_indices",
          lambda batch: tuple(PoolRow(v) for v in to_ints(batch.req_pool_indices) or [])),
    Field("req_pool_indices_cpu", "ScheduleBatch.req_pool_indices_cpu "
          "(absent: req_pool_indices)", _get_cpu_indices),
    Field("future_indices", "ScheduleBatch.spec_info.future_indices", _get_future_indices),
    # The field exists only in the closed PR #27979 (and in this model's cpu_ub cells).
    Field("seq_len_cpu_ub", "ScheduleBatch.seq_len_cpu_ub (absent: None)",
          lambda batch: getattr(batch, "seq_len_cpu_ub", None)),
    Field("is_prefill_only", "ScheduleBatch.is_prefill_only",
          lambda batch: bool(getattr(batch, "is_prefill_only", False))),
)
"""A :class:`~spec.state.BatchView` but its mode (:func:`read_forward_mode`) and its rids
(each reader numbers requests its own way)."""


def read_batch(batch: Any) -> dict[str, Any]:
    return {f.view: f.read(batch) for f in BATCH_FIELDS}


def read_free_pages(alloc: Any, page_size: int) -> list[int]:
    """The allocator's free pages: ``get_all_free_pages()`` on a paged allocator, else
    ``free_pages`` + ``release_pages``."""
    if hasattr(alloc, "get_all_free_pages") and page_size > 1:
        return to_ints(alloc.get_all_free_pages()) or []
    return (to_ints(alloc.free_pages) or []) + (to_ints(getattr(alloc, "release_pages", None))
                                                or [])


# Opt-in (issue 42, step 0 of docs/upstream-radix-sharing.md): the release's own radix tree
# on (python core, bigram keys under EAGLE), every match forced to zero by the release's
# ``SGLANG_RADIX_FORCE_MISS`` (mem_cache/common.py:240-243): inserts, locks, dedup and
# eviction run, nothing is shared. Off by default: the tier builds the tree disabled
# (``upstream/session.py``); ``overlap-spec upstream --radix-force-miss`` sets it.
RADIX_FORCE_MISS_ENV: Final = "OVERLAP_SPEC_UPSTREAM_RADIX_FORCE_MISS"


def is_radix_force_miss() -> bool:
    return os.environ.get(RADIX_FORCE_MISS_ENV, "") not in ("", "0")


# Which tree core the tier builds the release's tree on: "python" (the default) or "rust"
# (the release's own default, tree_core_backend=None resolving to SGLANG_UNIFIED_RADIX_TREE_
# CORE_BACKEND). ``overlap-spec upstream check --tree-core rust`` sets it.
TREE_CORE_ENV: Final = "OVERLAP_SPEC_UPSTREAM_TREE_CORE"
TREE_CORES: Final = ("python", "rust")


def get_tree_core() -> str:
    core = os.environ.get(TREE_CORE_ENV, "") or "python"
    if core not in TREE_CORES:
        raise ValueError(f"{TREE_CORE_ENV}={core!r}: the tree core is one of "
                         f"{', '.join(TREE_CORES)}")
    return core


def is_rust_core(tree: Any) -> bool:
    """Whether ``tree`` runs on the release's Rust tree core (``RustUnifiedTreeCore``)."""
    return type(getattr(tree, "tree_core", None)).__name__ == "RustUnifiedTreeCore"


def is_tree_on(config: ModelConfig) -> bool:
    """Whether the tier builds the release's tree enabled: a radix cell, or the opt-in."""
    return config.cell.radix or is_radix_force_miss()


def read_unlocked_tree_pages(tree: Any, page_size: int) -> list[int] | None:
    """The pages of the tree's unlocked device nodes (``component_data[FULL]``: ``value``,
    ``lock_ref``), walked from ``root_node`` on the python core; None when the core is not
    walkable (the Rust one). A locked node's pages are its one holder's (no match is
    shared under ``SGLANG_RADIX_FORCE_MISS``): its row holds them, and they count as that
    request's, so KV7's partition is unchanged."""
    core = getattr(tree, "tree_core", None)
    root = getattr(core, "root_node", None)
    if root is None:
        return None
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    full = ComponentType.FULL
    pages: list[int] = []
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        data = node.component_data[full]  # a list indexed by ComponentType
        if data.value is not None and data.lock_ref == 0:
            pages += dict.fromkeys(int(s) // page_size for s in data.value.tolist())
    return pages


def read_tree(tree: Any, page_size: int) -> TreeView:
    """The radix tree of a radix cell as :class:`~spec.state.TreeView`: every node with
    device KV, its key as the release iterates it (pairs under EAGLE), its pages (``value``
    slots // page), ``lock_ref`` and the tree's two sizes (``unified_radix_cache.py``
    ``evictable_size`` / ``protected_size``). On the python core all of it is read off the
    nodes; on the Rust core see :func:`read_rust_tree` (the keys' tokens are not readable
    there)."""
    if is_rust_core(tree):
        return read_rust_tree(tree, page_size)
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    full, root = ComponentType.FULL, tree.tree_core.root_node
    nodes: list[TreeNodeView] = []
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        data = node.component_data[full]
        if data.value is None:
            continue
        slots = data.value.tolist()
        nodes.append(TreeNodeView(
            int(node.id), None if node.parent is root else int(node.parent.id),
            tuple(node.key), tuple(PageId(int(s) // page_size) for s in slots[::page_size]),
            int(data.lock_ref)))
    return TreeView(tuple(sorted(nodes, key=lambda n: n.id)), int(tree.evictable_size()),
                    int(tree.protected_size()))


# One line of the Rust core's pretty_print (rust_tree_core/adapter.py:1256, printed by the
# extension): indentation (two spaces a level, one leading), the node's handle, its key
# length (pairs under EAGLE), its FULL lock count and whether it holds a device value.
_RUST_NODE_LINE: Final = re.compile(r"^ ((?:  )*)\[(\d+)\] (\d+) full_lock=(\d+) Full=(yes|no)$")
SLOT_KEYS_ATTRIBUTE: Final = "_overlap_spec_slot_keys"


def print_rust_tree(core: Any) -> str:
    """What the Rust core's ``pretty_print`` writes to file descriptor 1 (it prints from the
    extension, past Python's ``sys.stdout``), captured."""
    sys.stdout.flush()
    with tempfile.TemporaryFile() as capture:
        saved = os.dup(1)
        os.dup2(capture.fileno(), 1)
        try:
            core.pretty_print()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        capture.seek(0)
        return capture.read().decode()


def record_inserted_keys(tree: Any, key: Any, value: Any) -> None:
    """Remember the key element each inserted slot holds (``UnifiedRadixCache.insert``'s
    ``key``, iterated as the release iterates it, against its ``value`` slots): the Rust core
    keeps the tokens where Python cannot read them, and :func:`read_rust_tree` names a node's
    key by its slots. A slot in the tree was put there by the latest insert that carried it;
    an earlier insert's duplicate slot at the same position carries the same element."""
    keys: dict[int, Any] = tree.__dict__.setdefault(SLOT_KEYS_ATTRIBUTE, {})
    slots = to_ints(value) or []
    for slot, element in zip(slots, key, strict=False):
        keys[slot] = element


def read_rust_tree(tree: Any, page_size: int) -> TreeView:
    """The tree on the Rust core. Read from the core: the nodes (handles, nesting, key
    lengths and FULL lock counts, from ``pretty_print``; 0.5.23's Rust adapter raises
    NotImplementedError for ``root_node`` and ``node_by_id``), each node's slots
    (``get_component_device_value(node, FULL)``) and the two sizes. Not readable there: the
    keys' tokens. Each node's key is the elements the release's inserts gave its slots
    (:func:`record_inserted_keys`), so a key is checked to be as long as the core says and
    no slot may lack one, but a core that kept the right slots under wrong tokens is not
    seen in the key itself (only where a match then differs: the rows, cache_protected_len).
    """
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    core = tree.tree_core
    keys: dict[int, Any] = tree.__dict__.get(SLOT_KEYS_ATTRIBUTE, {})
    lines = [line for line in print_rust_tree(core).splitlines() if line.strip()]
    parents: list[tuple[int, int | None]] = []  # (depth, node id or None for the root)
    nodes: list[TreeNodeView] = []
    for number, line in enumerate(lines):
        match = _RUST_NODE_LINE.match(line)
        if match is None:
            raise RuntimeError(f"the Rust tree core's pretty_print line {number} is not a "
                               f"node line: {line!r}")
        depth, handle = len(match.group(1)) // 2, int(match.group(2))
        key_len, lock_ref = int(match.group(3)), int(match.group(4))
        while parents and parents[-1][0] >= depth:
            parents.pop()
        if depth == 0:  # the root (holds no value)
            parents.append((0, None))
            continue
        if not parents:
            raise RuntimeError(f"the Rust tree core printed node {handle} before its root")
        value = core.get_component_device_value(handle, ComponentType.FULL)
        parent = parents[-1][1]
        parents.append((depth, handle))
        if value is None:  # no device KV: skipped, as read_tree skips it on the python core
            continue
        slots = to_ints(value) or []
        if len(slots) != key_len:
            raise RuntimeError(f"the Rust tree core's node {handle}: key length {key_len}, "
                               f"{len(slots)} slots")
        missing = [slot for slot in slots if slot not in keys]
        if missing:
            raise RuntimeError(f"the Rust tree core's node {handle} holds slots no insert "
                               f"carried: {missing[:8]}")
        nodes.append(TreeNodeView(handle, parent, tuple(keys[slot] for slot in slots),
                                  tuple(PageId(s // page_size) for s in slots[::page_size]),
                                  lock_ref))
    return TreeView(tuple(sorted(nodes, key=lambda n: n.id)), int(tree.evictable_size()),
                    int(tree.protected_size()))


def read_prefix(tree: Any, req: Any) -> dict[str, Any]:
    """A radix cell's request: ``cache_protected_len`` and the node its lock holds (None: no
    lock, or the root's)."""
    lock = getattr(req, "lock", None)
    core = tree.tree_core
    root = int(core.root_node_handle() if is_rust_core(tree) else core.root_node.id)
    node = None if lock is None or int(lock.node) == root else int(lock.node)
    return {"cache_protected_len": int(get_kv(req).cache_protected_len), "lock_node": node}


def read_allocator(sched: Any, radix: bool = False) -> AllocatorView | None:
    """Free pages, the tree's unlocked pages (every tree page in a ``radix`` cell) and pool
    rows; None when a tree cache may hold pages this view cannot enumerate (the radix cache
    on a Rust core): KV4 and KV7 are then not judged. The tier builds its tree with
    ``disable=True``, or on the python core: a radix cell's, or with every match forced to
    miss (``is_radix_force_miss``)."""
    alloc, pool = sched.token_to_kv_pool_allocator, sched.req_to_token_pool
    page_size = int(getattr(alloc, "page_size", 1))
    tree = getattr(sched, "tree_cache", None)
    tree_pages: list[int] | None = []
    if radix:  # every page of the tree, the locked (shared) ones too
        tree_pages = [page for node in read_tree(tree, page_size).nodes for page in node.pages]
    elif tree is not None and not getattr(tree, "disable", False):
        tree_pages = read_unlocked_tree_pages(tree, page_size)
    if tree_pages is None:
        return None
    table = getattr(pool, "req_to_token", None)
    return AllocatorView(
        total_pages=int(alloc.size) // page_size, page_size=page_size,
        free_pages=tuple(PageId(p) for p in read_free_pages(alloc, page_size)),
        tree_pages=tuple(PageId(p) for p in tree_pages),
        free_pool_rows=tuple(PoolRow(int(r)) for r in pool.free_slots),
        pool_rows=int(pool.size),
        row_width=0 if table is None else int(table.shape[1]))


def get_undrivable_reason(config: ModelConfig) -> str | None:
    """None when the tier drives this cell on 0.5.23, else why it is n/a: the cell's
    switch names an earlier era or a proposal the release does not have."""
    cell = config.cell
    if cell.preclaim:
        return "the bonus pre-claim is an earlier era (#28754 removed it); 0.5.23 has no such path"
    if cell.overshoot:
        return ("the overshoot decode is an earlier era: 0.5.23's overlap loop sets "
                "enable_skip_finishing_decode (scheduler.py:2063)")
    if cell.trimmed_finish:
        return ("the trimmed finish is a proposal (#35694, open; #24745, closed); 0.5.23 "
                "commits the whole accepted run and caches Req.owned_kv_len() "
                "(schedule_batch.py:1552)")
    if cell.cpu_ub:
        return ("seq_len_cpu_ub is a proposal (the closed PR #27979); 0.5.23 keeps no host "
                "length without the mirror")
    if cell.early_fence:
        return ("the early fence is a proposal (this model's placement before 2026-11-26); "
                "0.5.23 records read-done after the draft-extend, whose attention metadata "
                "re-reads req_to_token (eagle_worker_v2.py:1365)")
    if cell.rung_reserve:
        return ("the rung reserve is a proposal (a fork's task #486); 0.5.23 reserves 2 * A "
                "of the widest rung (#26354)")
    return None


_CPU_STREAMS = ("streams and events are no-ops on CPU (torch.cpu.Stream, "
                "_war_barrier_enabled=False): no ordering exists to check; needs CUDA")
NOT_JUDGED_ON_RELEASE: Final[dict[str, str]] = {
    "SL8": ("the published values are the stand-in worker's: the release computes a "
            "verify's new_seq_lens inside run_eagle_verify (speculative/"
            "eagle_worker_common.py:716, seq_lens + accept_lens off CUDA; the triton "
            "prepare_verify_commit_outputs at :702/:712 on CUDA) after the target forward and "
            "eagle_sample, and a prefill's in _forward_prefill_batch (eagle_worker_v2.py:1567), "
            "which the stand-in replaces; running them is step 3 of the plan in "
            "docs/upstream-model-runner.md"),
    "KV10": "the bonus pre-claim is an earlier era (#28754); no 0.5.23 cell has it",
    "KV14": ("what each forward wrote where is the stand-in worker's, which keeps no KV "
             "buffer (the release's attention backends write it in code the stand-in "
             "replaces; docs/upstream-tier.md: the differential's kv_contents, not reported "
             "either)"),
    "FM1": _CPU_STREAMS,
    "FM2": _CPU_STREAMS,
    "FM3": _CPU_STREAMS,
    "ST1": _CPU_STREAMS,
    "ST2": _CPU_STREAMS,
    "ST3": "host syncs are not counted on CPU (every copy is synchronous there)",
    "ST4": _CPU_STREAMS,
}
"""Invariants the tier cannot judge on the release, with why: what the release computes
sits in code the stand-in replaces, or needs CUDA."""
