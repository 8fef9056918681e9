"""KV: the KV accounting. ``kv_committed_len`` (what a request's tokens own) against
``kv_allocated_len`` (slots reserved), the pages and pool rows behind them, and how they move
under retraction, finish, release, the bonus pre-claim, admission and chunked prefill."""

from dataclasses import replace

from overlap_spec.spec import transitions as tr
from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.invariants.registry import fail, invariant
from overlap_spec.spec.state import AdmissionView, AllocatorView, Observation, ObservationPoint


@invariant("KV1")
def check_kv1(config: ModelConfig, obs: Observation) -> int:
    """committed <= allocated <= width

    0 <= kv_committed_len <= kv_allocated_len <= row width for every request holding KV: the
    model's row (widened to the decode reserve), or the narrower one an implementation built and
    says it built (B21, B23, the release's page-1 tree; a trace without the allocator is held to
    the model's).

    Source: schedule_batch.py, PR 23456.
    """
    width = _get_row_width(config, obs)
    holding = obs.get_holding()
    for r in holding:
        if not 0 <= r.kv_committed_len <= r.kv_allocated_len <= width:
            past = " (allocated past the row)" if r.kv_allocated_len > width else ""
            raise fail("KV1", obs, f"for request r{r.rid}: kv_committed_len="
                       f"{r.kv_committed_len}, kv_allocated_len={r.kv_allocated_len}, "
                       f"row width={width}{past}")
    return len(holding)


def _get_row_width(config: ModelConfig, obs: Observation) -> int:
    """The row KV1 holds a request to: the model's, or the narrower one the
    implementation built and says it built (AllocatorView.row_width; 0 = not said)."""
    built = obs.allocator.row_width if isinstance(obs.allocator, AllocatorView) else 0
    return min(config.row_width, built or config.row_width)


def _past_the_row(config: ModelConfig, obs: Observation) -> str:
    """What a row or page miscount follows from when a request allocated past its
    req_to_token row (KV1; the release's kernel then writes the next row): said in the
    message, so a report names the cause."""
    width = _get_row_width(config, obs)
    past = [r.rid for r in obs.requests if r.kv_allocated_len > width]
    return f" (r{past[0]} allocated past its row)" if past else ""


@invariant("KV2", is_spec=False)
def check_kv2(config: ModelConfig, obs: Observation) -> int:
    """non-spec committed == allocated

    without speculation kv_committed_len == kv_allocated_len.

    Source: mem_cache/common.py release assertion.
    """
    holding = obs.get_holding()
    for r in holding:
        if r.kv_committed_len != r.kv_allocated_len:
            raise fail("KV2", obs, f"for request r{r.rid}: kv_committed_len="
                       f"{r.kv_committed_len} != kv_allocated_len={r.kv_allocated_len}")
    return len(holding)


@invariant("KV3", is_spec=True)
def check_kv3(config: ModelConfig, obs: Observation) -> int:
    """2x reserve covers draft+verify

    at a spec decode launch kv_allocated_len >= true length + W, so draft and verify write only
    reserved positions, and on pages > 1 it ends on a page boundary, the paged allocator's
    whole-page footprint.

    Source: eagle_info_v2.py 2x reserve; allocation_sizing.py page_aligned_decode_alloc_lens,
    #31616.
    """
    launch = obs.launch
    if obs.point is not ObservationPoint.LAUNCH or launch is None:
        return 0
    for write in launch.kv_write_faults:
        if write.reason == "beyond kv_allocated_len":
            raise fail("KV3", obs, f"for request r{write.rid}: forward wrote position "
                       f"{write.position} {write.reason}")
    if launch.forward_mode != "decode":
        return 0
    for m in launch.members:
        if m.kv_allocated_len < m.ghost_kv_len + m.write_width:
            raise fail("KV3", obs, f"for request r{m.rid}: kv_allocated_len="
                       f"{m.kv_allocated_len} < true length {m.ghost_kv_len} + W "
                       f"{m.write_width}")
        if m.kv_allocated_len % config.page_size:
            raise fail("KV3", obs, f"for request r{m.rid}: kv_allocated_len="
                       f"{m.kv_allocated_len} is not a multiple of the page size "
                       f"{config.page_size} after the spec-v2 prepare")
    return len(launch.members)


@invariant("KV4")
def check_kv4(config: ModelConfig, obs: Observation) -> int:
    """req_to_token rows own their slots

    req_to_token[row, 0:kv_allocated_len] holds slots of pages the request owns, and no page has
    two owners; with the radix cache, from ``cache_protected_len`` on (below it the row holds
    the tree's pages: RX4).

    Source: memory_pool.py ReqToTokenPool; schedule_batch.py ("The request's own KV is
    [cache_protected_len, kv_allocated_len)").
    """
    owner: dict[int, int] = {}
    holding = obs.get_holding()
    p = obs.allocator.page_size
    for r in holding:
        if len(r.row_slots) != r.kv_allocated_len:
            raise fail("KV4", obs, f"for request r{r.rid}: row holds {len(r.row_slots)} "
                       f"slots != kv_allocated_len={r.kv_allocated_len}"
                       f"{_past_the_row(config, obs)}")
        pages = set(r.owned_pages)
        needed = tr.compute_pages_for_len(r.kv_allocated_len, p) - r.cache_protected_len // p
        if len(pages) != needed:
            raise fail("KV4", obs, f"for request r{r.rid}: owns {len(pages)} pages but "
                       f"kv_allocated_len={r.kv_allocated_len} covers {needed} (stranded pages)")
        for page in pages:
            if page in owner:
                raise fail("KV4", obs, f"for request r{r.rid}: page {page} also owned by "
                           f"r{owner[page]}")
            owner[page] = r.rid
        for position, slot in enumerate(r.row_slots[r.cache_protected_len:],
                                        r.cache_protected_len):
            if slot // p not in pages:
                raise fail("KV4", obs, f"for request r{r.rid}: req_to_token position "
                           f"{position} holds slot {slot} outside its pages"
                           f"{_past_the_row(config, obs)}")
    if obs.launch is not None:
        for write in obs.launch.kv_write_faults:
            if write.reason != "beyond kv_allocated_len":
                raise fail("KV4", obs, f"for request r{write.rid}: forward wrote position "
                           f"{write.position} (slot {write.slot}): {write.reason}")
    return len(holding)


@invariant("KV5")
def check_kv5(config: ModelConfig, obs: Observation) -> int:
    """retracted requests hold nothing

    a retracted request holds nothing: committed == allocated == 0, no pool row, waiting to be
    re-admitted.

    Source: schedule_batch.py reset_for_retract.
    """
    retracted = [r for r in obs.requests if r.is_retracted]
    for r in retracted:
        if (r.kv_committed_len, r.kv_allocated_len) != (0, 0):
            raise fail("KV5", obs, f"for retracted request r{r.rid}: kv_committed_len="
                       f"{r.kv_committed_len}, kv_allocated_len={r.kv_allocated_len}, "
                       "expected 0 and 0")
        if r.req_pool_idx is not None or r.holds_kv or not r.waiting:
            raise fail("KV5", obs, f"for retracted request r{r.rid}: req_pool_idx="
                       f"{r.req_pool_idx}, holds_kv={r.holds_kv}, waiting={r.waiting}")
    return len(retracted)


@invariant("KV6")
def check_kv6(config: ModelConfig, obs: Observation) -> int:
    """released once, no change after

    KV is released once per holding, and after a finish release committed moves only by the
    pre-claim refunds.

    Source: mem_cache/common.py release_kv_cache, PR 23456/28754.
    """
    count = 0
    for r in obs.requests:
        if r.release_count > 1:
            raise fail("KV6", obs, f"for request r{r.rid}: released {r.release_count} times")
        if not r.finished:
            continue
        if obs.point is ObservationPoint.PROCESS_RESULT and r.holds_kv:
            raise fail("KV6", obs, f"for request r{r.rid}: finished but its KV was not "
                       "released after its result was processed")
        if r.committed_at_release is None:
            continue  # finished without a finish release: nothing settles after it
        # Only the J2-era spec pre-claim is refunded by late results (PR 23456).
        refund = r.inflight_at_release if (config.cell.is_spec and config.cell.preclaim
                                           and not r.ghost.extend_inflight) else 0
        settled = r.committed_at_release - refund
        high = settled if r.ghost.inflight_steps == 0 else r.committed_at_release
        if not settled <= r.kv_committed_len <= high:
            raise fail("KV6", obs, f"for request r{r.rid}: kv_committed_len="
                       f"{r.kv_committed_len} after release, expected in [{settled}, {high}]")
        # Non-trivial under overlap once a late result arrived after the release.
        late = r.inflight_at_release > 0 and r.ghost.inflight_steps == 0
        count += 1 if (late or not config.cell.overlap) else 0
    return count


@invariant("KV7")
def check_kv7(config: ModelConfig, obs: Observation) -> int:
    """pages and rows conserved

    every KV page is free, in the tree cache or owned by one request, and every pool row is free
    or held by one request.

    Source: invariant_checker._check_all_pools.
    """
    alloc = obs.allocator
    rows_held = [r.req_pool_idx for r in obs.requests if r.req_pool_idx is not None]
    pages = [*alloc.free_pages, *alloc.tree_pages,
             *(page for r in obs.requests for page in r.owned_pages)]
    if (len(set(pages)) == len(pages) == alloc.total_pages
            and len(set(rows_held)) == len(rows_held)
            and len(set(alloc.free_pool_rows)) == len(alloc.free_pool_rows)
            and len(rows_held) + len(alloc.free_pool_rows) == alloc.pool_rows
            and not set(rows_held) & set(alloc.free_pool_rows)):
        # Every page in exactly one place and every row too: the usual case, decided on
        # whole collections. Otherwise the walk below names the first misplaced one.
        return 1 if any(r.holds_kv for r in obs.requests) and alloc.tree_pages else 0
    seen: dict[int, str] = {}

    def place(page: int, where: str) -> None:
        if page in seen:
            raise fail("KV7", obs, f"for page {page}: both {seen[page]} and {where}")
        seen[page] = where

    for page in alloc.free_pages:
        place(page, "free")
    for page in alloc.tree_pages:
        place(page, "tree cache")
    rows: dict[int, str] = {row: "free" for row in alloc.free_pool_rows}
    for r in obs.requests:
        for page in r.owned_pages:
            place(page, f"owned by r{r.rid}")
        if r.req_pool_idx is not None:
            if r.req_pool_idx in rows:
                raise fail("KV7", obs, f"for pool row {r.req_pool_idx}: held by r{r.rid} "
                           f"and {rows[r.req_pool_idx]}")
            rows[r.req_pool_idx] = f"r{r.rid}"
    if len(seen) != alloc.total_pages:
        raise fail("KV7", obs, f"for the KV pool: {len(seen)} pages accounted for != "
                   f"{alloc.total_pages} total (leak){_past_the_row(config, obs)}")
    if len(rows) != alloc.pool_rows:
        raise fail("KV7", obs, f"for the request pool: {len(rows)} rows accounted for != "
                   f"{alloc.pool_rows} (leak)")
    return 1 if any(r.holds_kv for r in obs.requests) and alloc.tree_pages else 0


@invariant("KV8")
def check_kv8(config: ModelConfig, obs: Observation) -> int:
    """each step settles once

    each processed step settles exactly once: committed == settled truth + the lead of
    unprocessed claimed steps, for a live request and, where the release commits the whole
    accepted run, at the finish release too (less the bonus slot when a spec decode mixed into a
    prefill finishes: that result commits nothing); an abort mid-chunk has committed what its
    chunks wrote.

    Source: batch_result_processor.py, alloc_for_extend.
    """
    if obs.point is not ObservationPoint.PROCESS_RESULT:
        return 0
    settling = obs.get_settling()
    for r in settling:
        lead = tr.compute_committed_lead(config.cell, r.ghost.inflight_steps)
        if r.kv_committed_len != r.ghost.settled_len + lead:
            raise fail("KV8", obs, f"for request r{r.rid}: kv_committed_len="
                       f"{r.kv_committed_len} != settled true length {r.ghost.settled_len}"
                       f" + in-flight lead {lead}")
    # The trimmed finish commits less than it settled (KV9 says how much).
    released = [r for r in obs.requests
                if r.committed_at_release is not None and not config.cell.trimmed_finish]
    for r in released:
        lead = tr.compute_committed_lead(config.cell, r.claimed_at_release)
        if r.ghost.extend_inflight:  # an abort mid-chunk: each chunk commits when scheduled
            if r.committed_at_release != r.ghost.kv_len_true:
                raise fail("KV8", obs, f"for request r{r.rid}: kv_committed_len="
                           f"{r.committed_at_release} at its abort mid-chunk != the "
                           f"{r.ghost.kv_len_true} positions its chunks wrote")
        elif r.committed_at_release != r.ghost.settled_len + lead - r.ghost.finished_at_tail:
            raise fail("KV8", obs, f"for request r{r.rid}: kv_committed_len="
                       f"{r.committed_at_release} at its finish release != settled true "
                       f"length {r.ghost.settled_len} + claimed lead {lead}"
                       + (" - the finishing tail's slot" if r.ghost.finished_at_tail else ""))
    return len(settling) + len(released)


@invariant("KV9")
def check_kv9(config: ModelConfig, obs: Observation) -> int:
    """committed matches output

    committed KV matches the output. A live spec request has committed - lead == prompt +
    output - 1. At a finish the release has committed the whole accepted run (KV8 checks it
    against the settled truth) and caches ``owned_kv_len``: that cut at prompt + the visible
    output, all of it for an abort (no ``finished_len``); the trimmed finish commits and
    caches prompt + output - 1; an abort of the chunked request, its prefill pending, caches
    nothing. Of what it caches the tree keys the whole pages, one position short under EAGLE
    (compute_inserted_len), and the release frees the partial page.

    Source: ``_resolve_spec_v2_tokens``, ``Req.owned_kv_len``,
    ``process_pending_chunked_abort``, ``checkpoint_into_tree``; #22897 (M2); the proposal:
    #35694, #24590.
    """
    count = 0
    if obs.point is ObservationPoint.PROCESS_RESULT and config.cell.is_spec:
        for r in obs.get_settling():
            lead = tr.compute_committed_lead(config.cell, r.ghost.inflight_steps)
            expected = r.prompt_len + max(r.output_len, 1) - 1
            if r.kv_committed_len - lead != expected:
                raise fail("KV9", obs, f"for request r{r.rid}: kv_committed_len="
                           f"{r.kv_committed_len} - lead {lead} != prompt + output - 1 = "
                           f"{expected}")
            count += 1
    for r in obs.requests:
        if r.finished and not r.holds_kv and r.release_count > 0 and r.cached_len is None:
            raise fail("KV9", obs, f"for request r{r.rid}: released at its finish without "
                       "caching its KV")
        if r.cached_len is None or r.committed_at_release is None:
            continue
        committed = r.committed_at_release
        lead = tr.compute_committed_lead(config.cell, r.claimed_at_release)
        # The newest token has no KV yet. A prefill's token trimmed from view (a cap of 0)
        # was sampled all the same: the prompt's KV is all there.
        with_kv = r.prompt_len + max(r.output_len, 1) - 1
        shown = r.prompt_len + r.output_len
        trimmed, aborted = config.cell.trimmed_finish, r.finish_reason == "abort"
        expected = with_kv if trimmed else committed if aborted else min(committed, shown)
        rule = ("prompt + output - 1 (trimmed finish)" if trimmed else
                "kv_committed_len (abort)" if aborted else "owned_kv_len")
        if aborted and r.is_mid_prefill:  # mid-chunk: released, checkpoint=False
            expected, rule = 0, "nothing (a chunked request's abort)"
        if r.cached_len != expected:
            raise fail("KV9", obs, f"for request r{r.rid}: cached {r.cached_len} tokens at "
                       f"finish, expected {rule} = {expected} (prompt + visible output "
                       f"{shown}, committed {committed})")
        inserted = tr.compute_inserted_len(config.cell, r.cached_len)
        if r.inserted_len is not None and r.inserted_len != inserted:
            raise fail("KV9", obs, f"for request r{r.rid}: the tree keyed {r.inserted_len} of "
                       f"the {r.cached_len} cached positions, expected {inserted} (whole "
                       "pages" + (", one short: a bigram key)" if config.cell.is_spec else ")"))
        if trimmed and committed - lead != with_kv and not r.is_mid_prefill:
            raise fail("KV9", obs, f"for request r{r.rid}: kv_committed_len={committed} - "
                       f"claimed lead {lead} at finish != prompt + output - 1 = {with_kv}")
        count += 1
    return count


@invariant("KV10", is_spec=True, preclaim=True)
def check_kv10(config: ModelConfig, obs: Observation) -> int:
    """pre-claim inflation is the in-flight count

    with the bonus pre-claim, committed - settled truth == in-flight steps, 0 or 1.

    Source: eagle_info.py J2 era, PR 23456.
    """
    if obs.point is not ObservationPoint.PROCESS_RESULT:
        return 0
    settling = obs.get_settling()
    for r in settling:
        inflation = r.kv_committed_len - r.ghost.settled_len
        if inflation != r.ghost.inflight_steps:
            raise fail("KV10", obs, f"for request r{r.rid}: kv_committed_len="
                       f"{r.kv_committed_len} - settled {r.ghost.settled_len} = {inflation}"
                       f" != in-flight steps {r.ghost.inflight_steps}")
        if not 0 <= r.ghost.inflight_steps <= 1:
            raise fail("KV10", obs, f"for request r{r.rid}: {r.ghost.inflight_steps} steps "
                       "in flight, expected 0 or 1")
    return len(settling)


@invariant("KV11")
def check_kv11(config: ModelConfig, obs: Observation) -> int:
    """admission within the release's running-total estimate

    a prefill admits by the release's estimate of the running total: the chunked request's next
    chunk first (at most the chunk budget or, when positive and smaller, the budget left), then
    in queue order, each admitted request asks (fill + remaining max_new_tokens + a page) for
    less than the free KV less every running request's remaining max_new_tokens x
    new_token_ratio and what those admitted before it reserved (paged extend + a page +
    max_new_tokens unless cut into a first chunk); with chunked prefill each extend also spends
    the step's chunk budget, and a fill it cannot hold is cut to the budget's whole pages;
    admission stops at the first that does not fit, or when rows, budget or chunk budget run
    out. A mixed step first sets one token per running decode aside from the running total, the
    current total and the chunk budget, and a chunked request is never continued with no chunk
    budget left (the release would prefill an empty or negative chunk, ``extend_end <=
    prefix_len``; admissions keep the running requests below the chunk size while one is
    pending, and where PD-prebuilt arrivals fill it the chunk waits). With the radix cache a
    request's fill and chunk count from its matched prefix (which costs nothing), and the free
    KV is what its own check saw: its matched path pinned, earlier admissions' prefixes locked
    (the free term moves within one admission).

    Source: schedule_policy.py PrefillAdder, add_chunked_req, add_one_req's ``_lock_node``
    (:1409-1431), _commit_prefill_admission (:1685-1705), mem_cache/prefill_budget.py.
    """
    view = obs.admission
    return 0 if view is None or obs.batch is None else _judge_admission("KV11", config, obs, view)


def _judge_admission(check: str, config: ModelConfig, obs: Observation, view: AdmissionView) -> int:
    """KV11's rule applied to ``view``: the admission's own inputs (KV11), or the ones KV13
    re-derives from the requests and the allocator."""
    assert obs.batch is not None, "an admission is observed with its prefill"
    continued = view.continued
    admitted = tuple(rid for rid, *_ in view.waiting[:view.admitted])
    expected_rids = ((continued[0],) if continued else ()) + admitted
    if expected_rids != obs.batch.rids:
        raise fail(check, obs, f"for the prefill: it holds {list(obs.batch.rids)}, the "
                   f"admission admitted {list(expected_rids)}")
    page, clip, free = config.page_size, tr.CLIP_MAX_NEW_TOKENS, view.available_tokens
    # Summed as PrefillBudget sums them (float rounding included): 0, the running estimate,
    # then each admission's reservation.
    # A mixed step sets one token per running decode aside first, from both budgets.
    mixed = view.mixed_decode_tokens
    total: float = mixed + sum([min(max_new - out, clip) * view.new_token_ratio
                                for max_new, out in view.running])
    current = mixed
    chunk = None if not view.chunk_size else view.chunk_size - mixed
    if continued is not None:
        rid, prefix, fill, max_new, end = continued
        assert chunk is not None
        if chunk <= 0:  # nothing of the chunk budget left: the chunk would be empty
            raise fail(check, obs, f"for request r{rid}: continued with {chunk} left of the "
                       f"chunk budget ({mixed} running decode(s) set aside): an empty chunk "
                       f"[{prefix}, {end})")
        room = min(chunk, int(free - total))  # available_chunk_tokens, not page-floored
        expected = prefix + min(fill - prefix, room if room > 0 else chunk)
        expected = min(expected, view.continued_limit or expected)  # the model's cap (U8)
        if end != expected:
            raise fail(check, obs, f"for request r{rid}: its next chunk ends at {end}, the "
                       f"chunk budget {chunk} from prefix {prefix} of {fill} says {expected}")
        paged = tr.compute_page_align_up(end - prefix, page)
        total += paged + page + (min(max_new, clip) if end == fill else 0)
        current += paged + page
        chunk -= paged
    held = continued is not None
    for k, (rid, fill, max_new, out) in enumerate(view.waiting):
        # The radix cache: the extend starts past the matched prefix, and the free KV moves
        # as admissions lock their prefixes (the loop's top judges what the last one left).
        prefix = view.prefixes[k] if k < len(view.prefixes) else 0
        capacity = free - total > 0 and free - current > 0
        free = view.frees[k] if k < len(view.frees) else free
        asked = fill - prefix + min(max(max_new - out, 0), clip) + page
        fits = asked < free - total
        # A fill the chunk budget cannot hold is cut to its whole pages (none: OTHER).
        first = fill if chunk is None or -(-(fill - prefix) // page) * page <= chunk else (
            prefix + chunk // page * page)
        spent = capacity and first <= prefix
        if k == view.admitted:
            if (not view.latched and k + held < view.rows and capacity and fits
                    and not spent):
                raise fail(check, obs, f"for request r{rid}: left waiting though it asks "
                           f"{asked} tokens < {free - total:.3f} left (free {free}, chunk "
                           f"budget {chunk}, {len(view.running)} running)")
            return held + k + 1  # the continued request and the waiting ones judged
        if view.latched or k + held >= view.rows or not fits or spent:
            raise fail(check, obs, f"for request r{rid}: admitted asking {asked} tokens, "
                       f"{free - total:.3f} left (free {free}, rows {view.rows}, chunk budget "
                       f"{chunk}, latched {view.latched})")
        end = view.ends[k]
        if end != first:
            raise fail(check, obs, f"for request r{rid}: its extend ends at {end} of {fill} "
                       f"with {chunk} left of the chunk budget")
        paged = tr.compute_page_align_up(end - prefix, page)
        total += paged + page + (min(max_new, clip) if end == fill else 0)
        current += paged + page
        chunk = None if chunk is None else chunk - paged
    return held + len(view.waiting)


@invariant("KV12")
def check_kv12(config: ModelConfig, obs: Observation) -> int:
    """one chunked prefill, committed to its chunk, kept out of decode

    a prefill still pending is whole, or the scheduler's one chunked request's: committed and
    allocated to the end of its latest chunk, with at most one middle chunk in flight per launch
    the loop keeps queued (1 without overlap, 2 with), counted as the forward ran them (at an
    iteration's end, ``inflight_middle_chunks`` equals the middle chunks launched with results
    unprocessed), and in no decode batch until its last chunk is scheduled.

    Source: scheduler.py chunked_req, stash_chunked_request, Req.inflight_middle_chunks,
    batch_result_processor.py.
    """
    count = 0
    most = 2 if config.cell.overlap else 1
    for r in obs.requests:
        if not 0 <= r.inflight_middle_chunks <= most:
            raise fail("KV12", obs, f"for request r{r.rid}: inflight_middle_chunks="
                       f"{r.inflight_middle_chunks}, outside 0..{most}")
        if obs.point is ObservationPoint.ITERATION_END and r.holds_kv:
            if r.inflight_middle_chunks != r.ghost.middle_chunks:
                raise fail("KV12", obs, f"for request r{r.rid}: inflight_middle_chunks="
                           f"{r.inflight_middle_chunks}, {r.ghost.middle_chunks} middle "
                           "chunks in flight")
            count += 1
        if not (r.holds_kv and r.ghost.extend_inflight and not r.finished):
            continue
        count += 1
        fill = r.prompt_len + r.output_len
        # Whole: its extend reached the fill (a mixed step's one-token decode extend, taken
        # with the prefill's result still queued, ends past it).
        if r.extend_end >= fill and r.rid != obs.chunked_rid:
            continue
        if r.rid != obs.chunked_rid or not 0 < r.extend_end < fill:
            raise fail("KV12", obs, f"for request r{r.rid}: its prefill is pending at "
                       f"extend_end={r.extend_end} of {fill}, the chunked request is "
                       f"{obs.chunked_rid}")
        if not (r.prefix_len <= r.extend_end == r.kv_committed_len == r.kv_allocated_len):
            raise fail("KV12", obs, f"for request r{r.rid}: chunk [{r.prefix_len}, "
                       f"{r.extend_end}) with kv_committed_len={r.kv_committed_len}, "
                       f"kv_allocated_len={r.kv_allocated_len}")
    batch = obs.batch
    if (batch is not None and obs.chunked_rid is not None and obs.point in (
            ObservationPoint.PREPARE_FOR_DECODE, ObservationPoint.MERGE_BATCH)):
        if obs.chunked_rid in batch.rids:
            raise fail("KV12", obs, f"for request r{obs.chunked_rid}: mid-chunk in the "
                       f"{'decode' if batch.forward_mode == 'decode' else 'running'} batch")
        count += 1
    return count


@invariant("KV13", overshoot=False)
def check_kv13(config: ModelConfig, obs: Observation) -> int:
    """a waiting request the re-derived running load admits is admitted

    KV11's rule judged on inputs re-derived from the requests and the allocator, not read from
    the scheduler: at a prefill's admission the running load is every request holding KV that
    is neither finished, retracted, waiting nor in the prefill (the release filters the running
    batch at every step before PrefillAdder sums it, so a request a processed result finished
    no longer counts, while one whose queued result will finish it still does); the rows are
    max_running_requests less that count, at most the pool rows free before the prefill took
    its own (the continued chunk keeps its row); a mixed step sets one token per such request
    aside. By them a waiting request that fits, with a row free, is admitted, and each one
    admitted fits. The free KV and the new-token ratio are the admission's. N/a in the
    overshoot era: it filtered the running batch only in update_running_batch, after admission.

    Source: scheduler.py get_next_batch_to_run's every-step filter_batch (:3963-3968), before
    _get_new_batch_prefill_raw builds PrefillAdder from running_batch (:4157-4174);
    get_num_allocatable_reqs (:4027-4050); schedule_policy.py PrefillAdder.__init__ (:673-680),
    _get_running_request_total_token_offset (:785-794); schedule_batch.py filter_batch
    (:3845-3849: finished() requests leave).
    """
    view, batch = obs.admission, obs.batch
    if view is None or batch is None or not isinstance(obs.allocator, AllocatorView):
        return 0
    derived = [(r.max_new_tokens, r.output_len) for r in obs.requests if r.holds_kv and not (
        r.finished or r.is_retracted or r.waiting or r.rid in batch.rids)]
    # The same requests keep the scheduler's order: PrefillBudget's float sum depends on it.
    running = view.running if sorted(view.running) == sorted(derived) else tuple(derived)
    rows = min(config.preset.max_running_requests - len(running),
               len(obs.allocator.free_pool_rows) + len(batch.rids))
    # mixed_chunk is 0 or 1: one token set aside per running request with it.
    return _judge_admission("KV13", config, obs, replace(view, running=running, rows=rows,
                            mixed_decode_tokens=len(running) * config.preset.mixed_chunk))


@invariant("KV14")
def check_kv14(config: ModelConfig, obs: Observation) -> int:
    """a prefill writes its whole extend

    at an iteration's end, each live request holding KV holds in every column c of its row
    from p to ``extend_end`` (its prefill's, or its latest chunk's, end) the KV its own
    forward wrote for position c since its last retraction (writer ``compute_kv_writer``
    of its id and epoch, position c); p is ``cache_protected_len`` with the radix cache
    (below it the tree's pages, RX4) and 0 without; a PD-prebuilt request's KV arrived
    without a forward and is not judged. A forward that starts late (a retracted
    request's stale prefix offset, B36) leaves a column unwritten, or holding an older
    holding's write of a page it got back.

    Source: schedule_batch.py prepare_for_extend (``out_cache_loc`` for ``[len(prefix_indices),
    seq_len)``), reset_for_retract (``prefix_indices`` emptied), mem_cache/common.py
    alloc_for_extend.
    """
    if obs.point is not ObservationPoint.ITERATION_END:
        return 0
    judged = 0
    for r in obs.requests:
        if r.kv_contents is None or not r.is_live or r.prebuilt or r.extend_end <= 0:
            continue
        writer = tr.compute_kv_writer(r.rid, r.ghost.epoch)
        start = r.cache_protected_len if config.cell.radix else 0
        for c in range(start, r.extend_end):
            found = r.kv_contents[c] if c < len(r.kv_contents) else "no column"
            if found != (writer, c):
                raise fail("KV14", obs, f"for request r{r.rid}: column {c} of its extend "
                           f"[{start}, {r.extend_end}) holds {found}, expected its own write "
                           f"{(writer, c)} (epoch {r.ghost.epoch})")
        judged += 1
    return judged
