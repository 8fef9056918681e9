"""The abstract state the invariants are stated over.

An implementation (``reference/`` or ``gpu_impl/``) does not keep these objects;
its refinement function builds an :class:`Observation` at every observation
point of digest section 4 ("after any prepare_*, filter_batch, merge_batch,
resolve_seq_lens_cpu, or at FB.init_new entry"), plus the launch, the end of
``run_batch``, result processing and the end of an event-loop iteration.

Everything here is a frozen value. Lengths are token counts, rows are
``req_to_token`` / FutureMap rows (``req_pool_idx``), slots are KV slot ids.

Ghost state (:class:`GhostView`) is the truth the scheduler does not keep: what
the forward really wrote and what the environment really emitted. It is
maintained outside the scheduler logic, so a scheduler bug cannot corrupt it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Final

from overlap_spec.spec.happens_before import Race
from overlap_spec.spec.units import PageId, PoolRow, RequestId, SlotId, StepId, TokenCount


class ObservationPoint(enum.Enum):
    PREPARE_FOR_EXTEND = "prepare_for_extend"
    PREPARE_FOR_DECODE = "prepare_for_decode"
    FILTER_BATCH = "filter_batch"
    MERGE_BATCH = "merge_batch"
    RETRACT_DECODE = "retract_decode"
    RESOLVE_SEQ_LENS_CPU = "resolve_seq_lens_cpu"
    LAUNCH = "launch"  # after resolve_forward_inputs, before the worker runs
    INIT_NEW = "init_new"  # ForwardBatch.init_new entry (several per spec decode)
    DRAFT_EXTEND = "draft_extend"  # after the +D_tok mutation of the draft-extend FB
    RUN_BATCH = "run_batch"  # after isolation exit, run_batch returned
    PROCESS_RESULT = "process_result"
    ABORT = "abort"
    FLUSH_CACHE = "flush_cache"  # after a flush_cache that ran (a refused one changes nothing)
    PAUSE_GENERATION = "pause_generation"  # after pause_generation(mode="retract")
    ITERATION_END = "iteration_end"


SCHEDULE_SIDE_POINTS = frozenset(
    {
        ObservationPoint.PREPARE_FOR_EXTEND,
        ObservationPoint.PREPARE_FOR_DECODE,
        ObservationPoint.FILTER_BATCH,
        ObservationPoint.MERGE_BATCH,
        ObservationPoint.RETRACT_DECODE,
        ObservationPoint.RESOLVE_SEQ_LENS_CPU,
        ObservationPoint.RUN_BATCH,
    }
)


@dataclass(frozen=True)
class GhostView:
    """Truth per request, kept beside the scheduler and never written by it."""

    epoch: int  # bumps when a request is (re)admitted after a retraction
    kv_len_true: TokenCount  # positions whose KV the forward has really written and settled
    settled_len: TokenCount  # kv_len_true as of the last step processed while live
    inflight_steps: int  # steps prepared or launched in this epoch, result not yet processed
    extend_inflight: bool  # the prefill of this epoch is launched, its result not processed
    output_len_true: TokenCount  # output tokens the environment emitted to live processing
    finished: bool  # the environment's own view: EOS emitted or max_new_tokens reached
    finish_reason: str | None  # "abort" | "stop" | "length", by upstream's precedence
    verify_ct: int  # speculative verify results processed while the request was live
    correct_drafts: int  # their accepted drafts (accept_len - 1 each)
    middle_chunks: int = 0  # middle prefill chunks of this epoch forwarded, results unprocessed
    finished_at_tail: bool = False  # the finishing result was a spec mixed tail's (KV8)


@dataclass(frozen=True)
class RequestView:
    rid: RequestId
    prompt_len: TokenCount
    output_len: TokenCount
    max_new_tokens: TokenCount
    kv_committed_len: int  # int, not TokenCount: a bug can make it negative
    kv_allocated_len: int
    req_pool_idx: PoolRow | None
    finished: bool
    is_retracted: bool
    waiting: bool  # in the waiting queue
    holds_kv: bool  # has a pool row and KV not yet released
    row_slots: tuple[SlotId, ...]  # req_to_token[req_pool_idx, 0:kv_allocated_len]
    owned_pages: tuple[PageId, ...]
    release_count: int  # releases in the current epoch
    cached_len: int | None  # length handed to the tree cache at its finish release
    committed_at_release: int | None
    inflight_at_release: int  # launched, unprocessed steps when the finish release ran
    claimed_at_release: int  # the same plus a prepared step that was never launched
    finish_reason: str | None  # Req.finished_reason: "abort" | "stop" | "length" | None
    spec_verify_ct: int  # Req.spec_verify_ct
    spec_num_correct_drafts: int  # Req.spec_num_correct_drafts
    ghost: GhostView
    # The token values (RP7); None where an implementation or a trace does not show them.
    output_ids: tuple[int, ...] | None = None  # the visible output
    last_prompt_token: int | None = None  # origin_input_ids[-1]
    # Chunked prefill: Req.prefix_len (the earlier chunks' positions, checkpointed),
    # Req.extend_end (the latest extend's end), Req.inflight_middle_chunks.
    prefix_len: int = 0
    extend_end: int = 0
    inflight_middle_chunks: int = 0
    # Of cached_len, the positions the tree keyed at the finish release (KV9's inserted
    # half); None where the implementation does not say (a disabled tree, a trace).
    inserted_len: int | None = None
    # The radix prefix cache (cells with ``radix``): Req.kv.cache_protected_len (row[0:cpl]
    # is the tree's, the request's own KV is [cpl, kv_allocated_len)), the node its lock
    # holds (Req.lock / last_node; None: no lock), and the prompt's token family
    # (compute_prompt_token: two requests of one family share their prompt's prefix).
    cache_protected_len: int = 0
    lock_node: int | None = None
    prompt_family: int | None = None
    # KV14: per column of ``row_slots``, the (writer, position) of the last forward write
    # into its slot (spec.interface.RequestState.kv_contents); None: not shown (the upstream
    # tier's stand-in worker keeps no KV buffer; traces do not carry it).
    kv_contents: tuple[tuple[int, int] | None, ...] | None = field(
        default=None, metadata={"trace": False})
    # PD decode: its KV arrived without a prefill (``process_prebuilt``), until a retraction.
    prebuilt: bool = field(default=False, metadata={"trace": False})

    @property
    def is_live(self) -> bool:
        return self.holds_kv and not self.finished and not self.is_retracted

    @property
    def is_mid_prefill(self) -> bool:
        """Its prefill is not done (a chunked request's). A call trace carries no ghost (a
        stand-in that raises on any read): there a request with no output at all (an abort
        after a prefill keeps its token)."""
        ghost = self.ghost
        return ghost.extend_inflight if isinstance(ghost, GhostView) else self.output_len == 0


@dataclass(frozen=True)
class BatchView:
    """The running ``ScheduleBatch`` as the schedule side sees it."""

    forward_mode: str  # "extend" | "decode" | "mixed" | "idle"
    rids: tuple[RequestId, ...]
    seq_lens: tuple[int, ...]  # device seq_lens
    seq_lens_cpu: tuple[int, ...] | None
    seq_lens_sum: int | None
    req_pool_indices: tuple[PoolRow, ...]
    req_pool_indices_cpu: tuple[PoolRow, ...]
    future_indices: tuple[PoolRow, ...] | None  # spec_info.future_indices (spec overlap)
    seq_len_cpu_ub: int | None
    is_prefill_only: bool = False  # never decoded (Req.is_prefill_only of every member)


@dataclass(frozen=True)
class ForwardView:
    """A ``ForwardBatch`` at ``init_new`` (or after the draft-extend mutation)."""

    purpose: str  # "extend" | "decode" | "draft" | "verify" | "draft_extend"
    draft_tokens: int  # D_tok of this step's shape (1 without speculation)
    batch_size: int
    seq_lens: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...] | None
    seq_lens_sum: int | None
    schedule_batch: BatchView  # the SB at the same moment


@dataclass(frozen=True)
class LaunchMember:
    """One request of a launched batch, after ``resolve_seq_lens_cpu``."""

    rid: RequestId
    holds_kv: bool  # False: the request was released before this launch (B14)
    seq_len: int  # SB.seq_lens[j] the forward will use
    published_seq_len: int | None  # new_seq_lens_buf[pool_j] (spec), None if never published
    kv_allocated_len: int
    ghost_kv_len: TokenCount
    write_width: TokenCount  # positions this forward writes from seq_len on


@dataclass(frozen=True)
class KvWrite:
    """A KV write the forward made outside what the request owns (KV3 / KV4 evidence)."""

    rid: RequestId
    position: int
    slot: int | None  # None: req_to_token had no slot there
    reason: str


@dataclass(frozen=True)
class RelayGather:
    """A forward-side gather of a relay row (``output_tokens_buf``) at forward entry."""

    row: PoolRow
    rid: RequestId
    stashes_since_last_gather: int
    written_by_current_owner: bool


@dataclass(frozen=True)
class PublishRecord:
    rid: RequestId
    row: PoolRow
    seq_len_in: int
    accept_len: int | None  # None for an extend publish
    value: int


@dataclass(frozen=True)
class LaunchView:
    step: StepId
    forward_mode: str
    members: tuple[LaunchMember, ...]
    kv_write_faults: tuple[KvWrite, ...]
    relay_gathers: tuple[RelayGather, ...]
    unseeded_spec_rows: tuple[tuple[RequestId, PoolRow], ...]  # resolve read a never-published row
    publishes: tuple[PublishRecord, ...]


@dataclass(frozen=True)
class IsolationView:
    """SB at ``_forward_isolation`` entry and after ``run_batch`` returned."""

    entry: BatchView
    exit: BatchView
    reapplied_seq_lens: tuple[int, ...] | None  # non-overlap spec: R.new_seq_lens


@dataclass(frozen=True)
class ResolveView:
    """``resolve_seq_lens_cpu``: which rows were read and whether publish_ready covered them."""

    rows: tuple[PoolRow, ...]
    uncovered_rows: tuple[PoolRow, ...]  # last publish of the row not captured by publish_ready
    # publish_ready re-armed by a publish since the previous resolve consumed it; None when
    # no publish has recorded it yet (nothing to consume: upstream skips the wait)
    fresh_publish: bool | None = None
    # rows a previous resolve gathered with no publish of them since (upstream's CI writes
    # -1 into each gathered row and asserts the next gather reads none)
    regathered_rows: tuple[PoolRow, ...] = ()


@dataclass(frozen=True)
class ProcessedEntry:
    rid: RequestId
    stale: bool  # finished or retracted when the result was processed
    finished_before: bool
    accept_len: int
    run_len: int
    stride: int
    output_before: int
    output_after: int
    committed_before: int
    committed_after: int


@dataclass(frozen=True)
class AdmissionView:
    """What a prefill's admission decided from (``PrefillAdder``'s inputs), for KV11."""

    new_token_ratio: float
    available_tokens: int  # the allocator's free tokens plus the evictable cache
    rows: int  # min(max_running_requests - running, free pool rows)
    running: tuple[tuple[int, int], ...]  # (max_new_tokens, output_len) per running request
    # (rid, fill_len, max_new_tokens, output_len) per waiting request, in queue order; the
    # first ``admitted`` of them were admitted.
    waiting: tuple[tuple[RequestId, int, int, int], ...]
    admitted: int
    # Chunked prefill: chunked_prefill_size (0: off); the chunked request continued first,
    # as (rid, prefix_len, fill_len, max_new_tokens, extend_end); each admitted waiting
    # request's extend end; whether batch_is_full was latched before this admission.
    chunk_size: int = 0
    continued: tuple[RequestId, int, int, int, int] | None = None
    ends: tuple[int, ...] = ()
    latched: bool = False
    # Mixed chunks: the running decodes the admission set aside (``num_mixed_decode_tokens``,
    # one per running request; 0 unless is_mixed_chunk), from the chunk and token budgets.
    mixed_decode_tokens: int = 0
    # The model's own cap on the continued chunk's end: the row's pages and the free ones
    # (the release takes the whole chunk budget there and dies, "Prefill out of memory":
    # U8). None: the release's rule alone.
    continued_limit: int | None = None
    # The radix cache, per waiting request that was matched (in queue order, from the first):
    # its matched prefix (its extend starts there) and the free KV its check saw, its own
    # matched path pinned and earlier admissions' locks held (add_one_req's ``_lock_node``).
    # Past them, no prefix and the free KV the last one left. Empty: no radix cache.
    prefixes: tuple[int, ...] = ()
    frees: tuple[int, ...] = ()


@dataclass(frozen=True)
class ResultView:
    step: StepId
    entries: tuple[ProcessedEntry, ...]
    num_correct_drafts: int  # the global counter as the processor computed it
    metrics_batch_size: int
    previous_step: StepId | None  # the step processed before this one
    pending_after: int  # results still queued after this one
    # Whether this result fed the spec metrics (update_spec_metrics: spec decode results
    # only); an unmetered result reports (0, 0) and makes no counter claim.
    metered: bool = True


@dataclass(frozen=True)
class PlacementView:
    """Where the scheduler keeps its requests at the end of an iteration (RP10), by id:
    ``waiting_queue``, ``running_batch.reqs``, ``last_batch.reqs`` (with its mode, and
    whether it is the running batch itself, as a launched decode is) and each batch in
    flight (``result_queue``: launched, result not processed), oldest first."""

    waiting: tuple[RequestId, ...]
    running: tuple[RequestId, ...]
    last: tuple[RequestId, ...]
    last_mode: str | None  # None: no last batch
    last_is_running: bool
    in_flight: tuple[tuple[RequestId, ...], ...]


@dataclass(frozen=True)
class AllocatorView:
    total_pages: int
    page_size: int
    free_pages: tuple[PageId, ...]
    tree_pages: tuple[PageId, ...]
    free_pool_rows: tuple[PoolRow, ...]
    pool_rows: int
    row_width: int = 0  # req_to_token's columns, as the implementation built it (0: not said)


@dataclass(frozen=True)
class TreeNodeView:
    """One node of the radix tree: its key (whole pages of tokens, bigrams under EAGLE), one
    page per page of the key, its parent (None: a child of the root) and its lock count."""

    id: int
    parent: int | None
    key: tuple[object, ...]
    pages: tuple[PageId, ...]
    lock_ref: int


@dataclass(frozen=True)
class TreeView:
    """The radix tree (``UnifiedRadixCache``): its nodes (the root left out) and its sizes in
    tokens, as the release keeps them (``evictable_size_`` / ``protected_size_``)."""

    nodes: tuple[TreeNodeView, ...]
    evictable_size: int
    protected_size: int

    def get_path(self, node_id: int | None) -> list[TreeNodeView]:
        """The nodes from the root's child down to ``node_id`` (empty for None); a
        :class:`KeyError` for a node not in the tree."""
        by_id = {node.id: node for node in self.nodes}
        path: list[TreeNodeView] = []
        while node_id is not None:
            path.append(by_id[node_id])
            node_id = by_id[node_id].parent
        return path[::-1]


@dataclass(frozen=True)
class Observation:
    """Everything one observation point shows. Parts that do not apply are None."""

    point: ObservationPoint
    step_index: int  # index of the operation in the script that produced it
    requests: tuple[RequestView, ...]
    batch: BatchView | None
    allocator: AllocatorView
    races: tuple[Race, ...]  # races found since the previous observation
    forward: ForwardView | None = None
    launch: LaunchView | None = None
    isolation: IsolationView | None = None
    resolve: ResolveView | None = None
    result: ResultView | None = None
    admission: AdmissionView | None = None
    host_syncs: tuple[str, ...] | None = None  # at ITERATION_END: syncs of this iteration
    chunked_rid: RequestId | None = None  # Scheduler.chunked_req (chunked prefill)
    launched_this_iteration: bool = False
    placement: PlacementView | None = None  # at ITERATION_END (None: not shown, a trace's call)
    tree: TreeView | None = None  # the radix tree (cells with ``radix``; None elsewhere)
    paused: bool = False  # pause_generation holds the loop (``Scheduler._engine_paused``)
    # Cross-participant access pairs whose order was checked since the previous
    # observation (races included): the stream claims' witnesses. Not written to traces:
    # the trace checker recomputes them from the stream events.
    checked_pairs: tuple[Race, ...] = field(default=(), metadata={"trace": False})

    def get_request(self, rid: RequestId) -> RequestView:
        for request in self.requests:
            if request.rid == rid:
                return request
        raise KeyError(rid)

    def get_holding(self) -> list[RequestView]:
        """The requests holding KV."""
        return [r for r in self.requests if r.holds_kv]

    def get_settling(self) -> list[RequestView]:
        """Live requests whose prefill result is processed: they have settled something."""
        return [r for r in self.requests if r.is_live and not r.ghost.extend_inflight]

    def get_schedule_batches(self) -> list[BatchView]:
        """The ScheduleBatch as the schedule side shows it here, and as the forward saw it."""
        own = [self.batch] if self.point in SCHEDULE_SIDE_POINTS and self.batch is not None else []
        return own + ([self.forward.schedule_batch] if self.forward is not None else [])


@dataclass(frozen=True)
class IterationChoices:
    """The environment's choices for one event-loop iteration.

    ``accept_lens[j]`` and ``j in eos_positions`` apply to the request at position j
    of the batch launched this iteration (values wrap around the tuple; accept
    lengths are clamped into [1, max_accept_len]). ``allow_prefill`` lets the
    scheduler admit waiting requests; ``retract`` asks it to retract that many
    running requests before preparing a decode (a memory-pressure decision).
    ``disable_overlap`` is upstream's ``is_disable_overlap_for_batch`` (consecutive
    prefills, grammar with spec); ``spec_steps`` is the adaptive controller's rung;
    ``eos_offset`` puts EOS inside an accepted run (a stop before its end, #22897).
    """

    allow_prefill: bool = True
    retract: int = 0
    accept_lens: tuple[int, ...] = (1,)
    eos_positions: frozenset[int] = frozenset()
    disable_overlap: bool = False  # process the pending result before launching (grammar sync)
    spec_steps: int = 0  # adaptive rung for this iteration's decode; 0 = configured maximum
    eos_offset: int = 0  # EOS sits this many tokens before the end of the accepted run

    def get_accept_len(self, position: int, max_accept_len: int) -> int:
        raw = self.accept_lens[position % len(self.accept_lens)] if self.accept_lens else 1
        return min(max(raw, 1), max_accept_len)

    def is_eos(self, position: int) -> bool:
        return position in self.eos_positions

    def get_eos_index(self, position: int, accept_len: int) -> int | None:
        """Where EOS falls inside the request's accepted run, or None."""
        return max(accept_len - 1 - self.eos_offset, 0) if self.is_eos(position) else None


# --- the environment's tokens --------------------------------------------------------------
# The stand-in model every implementation runs against. A token is a function of the request,
# its absolute position and the token before it, as a language model's would be: a forward
# that reads the wrong input token (a relayed sampled / bonus token that is not the one
# produced) or runs at the wrong position emits a token the environment did not (RP7). The
# chain starts at the prompt's last token; a speculative run chains inside itself from the
# bonus token it was launched with, and EOS replaces a token where the environment stops.
EOS_TOKEN: Final = 0
REFUSED_PROMPT_TOKEN: Final = 0  # set_finish_with_abort leaves origin_input_ids = [0]


def compute_prompt_token(family: int, index: int) -> int:
    """Token ``index`` of a prompt of ``family`` (never EOS). A request's family is its own
    id unless it was admitted into another's (``Admit.family``): then the two prompts
    agree wherever both have a token, which is what a radix tree can share."""
    return 100 + (family * 13 + index) % 800


def get_last_prompt_token(family: int, prompt_len: int, refused: bool) -> int:
    return REFUSED_PROMPT_TOKEN if refused else compute_prompt_token(family, prompt_len - 1)


def get_prompt_tokens(family: int, prompt_len: int, refused: bool) -> list[int]:
    """``origin_input_ids``: a refused prompt is the one token ``set_finish_with_abort``
    leaves."""
    if refused:
        return [REFUSED_PROMPT_TOKEN]
    return [compute_prompt_token(family, i) for i in range(prompt_len)]


def compute_env_token(rid: int, position: int, previous: int) -> int:
    """The token the model emits at absolute ``position`` after ``previous`` (never EOS)."""
    return 1 + (rid * 31 + position * 7 + previous * 11) % 97


def get_env_tokens(rid: int, position: int, previous: int, count: int) -> list[int]:
    """``count`` tokens from ``position`` on, each chained on the one before it."""
    tokens: list[int] = []
    for k in range(count):
        previous = compute_env_token(rid, position + k, previous)
        tokens.append(previous)
    return tokens
