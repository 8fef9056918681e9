"""The arithmetic of every scheduler transition, as pure functions over ints (admission's
new-token estimate excepted: a float, as in the release).

These are the rules the design promises; ``relation.py`` applies them to a
request (which transition, its guard, frame and ghost update), ``reference/``
calls that relation and the batch-level ones here, and ``proofs/`` interprets
the same definitions over Z3 terms. Each function states which state variable
it computes; the transition that uses it changes only that variable (frame).

Timeline of one overlapped iteration i (digest section 3)::

    host : prepare(B_i) ── run_batch(B_i) ── WAR fence ── process(R_{i-1}) ──▶
    S    :  alloc rows      resolve gather     wait F_i     frees
    F    :  ...F_{i-1}...  | F.wait(S) → inputs → verify → publish → draft_extend → stash
    D    :                   wait publish_ready_{i-1} → copy → (host blocks)
    C    :                                               copy R_i → copy_done_i

Meaning of ``seq_lens`` (digest 0.3): non-spec decode counts the token being
processed; spec-v2 counts the KV-ready committed prefix without the pending
bonus token.
"""

from __future__ import annotations

from overlap_spec.spec.config import Cell, SpecShape
from overlap_spec.spec.units import TokenCount


def compute_ceil_div(value: int, divisor: int) -> int:
    return -(-value // divisor)


def compute_page_align_up(length: int, page_size: int) -> int:
    return compute_ceil_div(length, page_size) * page_size


def compute_pages_for_len(length: int, page_size: int) -> int:
    """Pages a row needs to hold ``length`` positions."""
    return compute_ceil_div(length, page_size)


# --- handle_generate_request ---------------------------------------------------
def compute_admission(prompt_len: int, requested: int, context_len: int, kv_tokens: int,
                      page_size: int) -> tuple[int, bool]:
    """(max_new_tokens, refused) of a new request: ``init_req_max_new_tokens`` caps the
    request to ``max_req_len - prompt - 1`` (``max_req_len = min(context_len, pool) - 1``,
    tp_worker.py), then to what an empty pool holds after the paged prompt and one page;
    ``validate_input_length`` refuses a prompt of ``max_req_len - 5`` tokens or more."""
    max_req_len = min(context_len, kv_tokens) - 1
    capped = max(0, min(requested, max_req_len - prompt_len - 1))
    capped = max(0, min(capped, kv_tokens - compute_page_align_up(prompt_len, page_size)
                        - page_size - 1))
    return capped, prompt_len >= max_req_len - 5


# --- get_new_batch_prefill: PrefillAdder's memory budget -----------------------
# The release admits by an estimate of the tokens still to come (schedule_policy.py
# PrefillAdder, mem_cache/prefill_budget.py PrefillBudget, scheduler_components/
# new_token_ratio_tracker.py). The estimate is a Python float: the one place here that is
# not over ints, computed in the release's order so the two round alike.
CLIP_MAX_NEW_TOKENS = 4096
INIT_NEW_TOKEN_RATIO = min(0.7 * 1.0, 1.0)  # SGLANG_INIT_NEW_TOKEN_RATIO x conservativeness
MIN_NEW_TOKEN_RATIO = min(INIT_NEW_TOKEN_RATIO * 0.14, 1.0)  # x ..._MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600  # ..._DECAY_STEPS
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS


def compute_running_token_offset(max_new_tokens: int, output_len: int, ratio: float) -> float:
    """What a running request still claims of the pool (``_get_running_request_total_token_
    offset``): its remaining ``max_new_tokens``, clipped, times the new-token ratio. Not
    clamped at 0."""
    return min(max_new_tokens - output_len, CLIP_MAX_NEW_TOKENS) * ratio


def compute_prefill_check_tokens(fill_len: int, max_new_tokens: int, output_len: int,
                                 page_size: int, prefix_len: int = 0) -> int:
    """What ``add_one_req`` asks the budget for: the extend (the fill past a matched radix
    prefix, which costs nothing: schedule_policy.py:1409-1412), the remaining
    ``max_new_tokens`` (clipped, at least 0) and a page; admitted while it is ``<`` what
    remains."""
    return (fill_len - prefix_len + min(max(max_new_tokens - output_len, 0), CLIP_MAX_NEW_TOKENS)
            + page_size)


def compute_prefill_reserved_tokens(fill_len: int, max_new_tokens: int, page_size: int) -> int:
    """What an admitted request then reserves (``PrefillBudget.reserve``): the paged fill, a
    page and the whole ``max_new_tokens`` (not what remains of it, P:1636)."""
    return (compute_page_align_up(fill_len, page_size) + page_size
            + min(max_new_tokens, CLIP_MAX_NEW_TOKENS))


def compute_decayed_ratio(ratio: float) -> float:
    """``NewTokenRatioTracker.decay_step``: after a decode scheduled without retraction."""
    return max(ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)


def compute_ratio_after_retract(output_lens: list[int], max_new_tokens: list[int]) -> float:
    """``estimate_new_token_ratio_after_retract`` over the requests a retraction kept (an
    empty batch, after the out-of-memory abort of the last one, gives 0.0)."""
    estimate = ((sum(output_lens) + RETRACT_DECODE_STEPS * len(output_lens))
                / (sum(max_new_tokens) + 1))
    return min(1.0, estimate)


def compute_chunk_first_end(fill_len: int, chunk_budget: int | None, page_size: int,
                            prefix_len: int = 0) -> int:
    """``_select_prefill_admission``: where a prompt's first extend, from its matched radix
    prefix (page-aligned), ends. All of it when chunking is off or the extend's paged length
    fits what is left of the step's chunk budget; else that budget page-floored past the
    prefix (a first chunk, reserving no ``max_new_tokens``; at most ``prefix_len``: no page
    is left, ``AddReqResult.OTHER``)."""
    if chunk_budget is None or compute_page_align_up(fill_len - prefix_len,
                                                     page_size) <= chunk_budget:
        return fill_len
    return prefix_len + chunk_budget // page_size * page_size


def compute_chunk_continuation_end(prefix_len: int, fill_len: int, chunk_budget: int,
                                   remaining_total: int,
                                   allocatable_end: int | None = None) -> int:
    """``add_chunked_req``: the chunked request's next extend, from its checkpointed prefix,
    at most the chunk budget or, when positive, the budget's remaining total if smaller
    (``PrefillBudget.available_chunk_tokens``); not page-floored. The release takes the
    whole budget even into a pool the decodes hold, and dies (U8); ``allocatable_end``,
    the model's own rule, caps it to the row's and the free pages (the chunk may wait)."""
    room = min(chunk_budget, remaining_total)
    end = prefix_len + min(fill_len - prefix_len, room if room > 0 else chunk_budget)
    return end if allocatable_end is None else min(end, allocatable_end)


# --- prepare_for_extend ------------------------------------------------------
def compute_fill_len(prompt_len: int, output_len: int) -> TokenCount:
    """Prefill length: the prompt plus every output token (re-prefill after retraction).

    Changes: seq_lens[j], kv_committed_len, kv_allocated_len (all = fill_len).
    Leaves: output_ids, finished state.
    """
    return TokenCount(prompt_len + output_len)


# --- update_running_batch ------------------------------------------------------
def compute_output_budget(max_new_tokens: int, output_len: int, aborting: bool = False) -> int:
    """Output tokens a result may still keep (the visible output, ``finished_len``).

    A prefill appends its sampled token before any finish check. At ``max_new_tokens=0``
    (a cap ``compute_admission`` gives a refused prompt, or any prompt a small pool
    leaves no room after) a length or stop finish sets ``finished_len = 0`` and shows
    none (``update_finish_state``); an abort promoted at that result sets no
    ``finished_len``, so the token stays visible (``aborting``: an abort is pending)."""
    return max(max_new_tokens, 1 if aborting else 0) - output_len


def is_prefill_only(is_spec: bool, max_new_tokens: list[int]) -> bool:
    """``Req.is_prefill_only`` of every member: a batch that generates nothing (each
    request capped to 0 new tokens) and does not speculate. The release launches its
    prefill and never a decode of it (``get_next_batch_to_run`` skips
    ``update_running_batch`` for a prefill-only running batch)."""
    return not is_spec and bool(max_new_tokens) and all(m == 0 for m in max_new_tokens)


def is_next_output_finishing_by_length(output_len: int, max_new_tokens: int) -> bool:
    """``Req.next_output_finishes_by_length``: one more output token reaches the cap.

    Under overlap (``Cell.skips_finishing_decode``) a member of the queued result's
    batch for which this holds is left out of the next decode: that result commits at
    least one token, so it finishes the request by length whatever it accepts.
    """
    return output_len + 1 >= max_new_tokens


# --- prepare_for_decode --------------------------------------------------------
def compute_decode_seq_len_ns(seq_len: int) -> int:
    """Non-spec decode: seq_lens' = seq_lens + 1; the pre-claimed slot is at column seq_lens."""
    return seq_len + 1


def compute_v2_alloc_target(committed: int, allocated: int, reserve: int, page_size: int,
                            faults: frozenset[str] = frozenset()) -> int:
    """Spec-v2 ``prepare_for_decode``: nxt = page_align(max(cur, committed + 2A)).

    The clamp keeps the allocation monotone after an adaptive down-switch (B12 drops it,
    stranding the pages past the shrunk length); the page rounding is the release's
    (``page_aligned_decode_alloc_lens``; B22 drops it, #31616's "before"). Changes
    kv_allocated_len only; seq_lens, seq_lens_cpu and seq_lens_sum are untouched (they are
    one verify stale under overlap and are fixed by resolve_seq_lens_cpu).
    """
    if "B12" in faults:
        return compute_page_align_up(committed + reserve, page_size)
    if "B22" in faults:
        return max(allocated, committed + reserve)
    return compute_page_align_up(max(allocated, committed + reserve), page_size)


def compute_v2_decode_pages_needed(
    committed: int, allocated: int, reserve: int, page_size: int
) -> int:
    """``_new_tokens_required_next_decode_spec_v2`` in pages, for ``check_decode_mem``."""
    target = compute_v2_alloc_target(committed, allocated, reserve, page_size)
    return compute_pages_for_len(target, page_size) - compute_pages_for_len(allocated, page_size)


def compute_ns_decode_pages_needed(seq_len: int, page_size: int) -> int:
    """A non-spec decode needs a new page when the new column starts one."""
    return 1 if seq_len % page_size == 0 else 0


# --- the forward ---------------------------------------------------------------
def compute_verify_new_seq_len(seq_len: int, accept_len: int) -> int:
    """SL8: verify of a request at seq_lens=s publishes s + accept_len."""
    return seq_len + accept_len


def compute_draft_writes(seq_len: int, shape: SpecShape, page_size: int
                         ) -> tuple[list[int], list[tuple[int, int]]]:
    """The draft's KV writes from ``seq_len``: its slots, and its copies (target, source).

    Page 1, or a chain: branch t's step j at s + t*steps + j (#7163's layout). A tree on
    pages > 1 (PR 26972, ``eagle_worker_common.py`` ``prepare_for_draft``): with lp = s %
    page and n = ceil((lp + steps) / page) pages a branch, branch t's region starts at
    s - lp + t*n*page and drafts from its offset lp; the KV of the partial last page
    [s - lp, s) is copied into the same lp holes of every other branch
    (``duplicate_prefix_tail_to_draft_branches``). The rest of a region is padding.
    """
    steps, topk = shape.steps, shape.topk
    if page_size == 1 or topk == 1:
        return [seq_len + t * steps + j for t in range(topk) for j in range(steps)], []
    lp = seq_len % page_size
    base = seq_len - lp
    span = (lp + steps + page_size - 1) // page_size * page_size
    slots = [base + t * span + lp + j for t in range(topk) for j in range(steps)]
    copies = [(base + t * span + i, base + i) for t in range(1, topk) for i in range(lp)]
    return slots, copies


def compute_forward_write_width(shape: SpecShape, forward_mode: str, page_size: int = 1,
                                seq_len: int | None = None) -> TokenCount:
    """How far past seq_lens a decode forward writes (KV3): its writes lie in [s, s + W).

    Non-spec: one (the token being processed). Spec-v2: the draft's writes
    (:func:`compute_draft_writes`) and the verify's D_tok, so on page 1
    W = max(topk*steps, D_tok). A tree on pages > 1 reaches its last branch's last slot,
    s - lp + (topk-1)*n*page + lp + steps, and n depends on lp = s % page; without
    ``seq_len`` W is the widest, at lp = page - 1 (what a prover that does not track the
    residue claims). Computed from the shape's primitive fields, not from
    ``alloc_len_per_decode``, so a wrong reserve formula cannot hide behind the same
    wrong number here.
    """
    if forward_mode != "decode":
        return TokenCount(0)
    if shape.steps == 0:
        return TokenCount(1)
    if page_size == 1 or shape.topk == 1:
        return TokenCount(max(shape.topk * shape.steps, shape.draft_tokens))
    lp = page_size - 1 if seq_len is None else seq_len % page_size
    span = compute_page_align_up(lp + shape.steps, page_size)
    return TokenCount(max((shape.topk - 1) * span + shape.steps, shape.draft_tokens))


def compute_draft_extend_seq_lens(seq_lens: tuple[int, ...], draft_tokens: int) -> tuple[int, ...]:
    """SL10: the draft-extend forward sees seq_lens + D_tok, on its ForwardBatch only."""
    return tuple(s + draft_tokens for s in seq_lens)


# --- result processing ---------------------------------------------------------
def compute_retraction_order(cell: Cell, output_lens: list[int],
                             prompt_lens: list[int]) -> list[int]:
    """Batch positions in retraction order, the next victim last (``retract_decode`` pops).

    The release (``_get_decode_retraction_order``, PR 32023, 2026-07-23), spec and
    non-spec alike: sorted by (len(output_ids), -len(origin_input_ids)) descending, so
    the fewest outputs, then the longest prompt, go first; ties keep batch order, the
    later position first. The pre-claim era (PR 23456 to PR 28754, 2026-04 to 06)
    predates PR 32023: there speculative decoding retracted from the back of the batch.
    """
    order = list(range(len(output_lens)))
    if cell.retracts_spec_from_back:
        return order
    order.sort(key=lambda j: (output_lens[j], -prompt_lens[j]), reverse=True)
    return order


def compute_run_len(accept_len: int, remaining_budget: int, eos_at: int | None) -> int:
    """Tokens of the accepted run the client sees: cut at EOS and at max_new_tokens
    (``finished_len``, ``Req.output_ids_through_stop``)."""
    run = min(accept_len, max(remaining_budget, 0))
    if eos_at is not None:
        run = min(run, eos_at + 1)
    return run


def compute_committed_run(cell: Cell, accept_len: int, run_len: int) -> int:
    """Tokens of a live row's accepted run that are committed (and appended).

    The release commits the whole accepted run (``_resolve_spec_v2_tokens``:
    ``kv_committed_len += len(accept_tokens)``) and hides what runs past the stop or the
    cap behind ``finished_len``. The ``trimmed_finish`` proposal cuts the run first.
    """
    return run_len if cell.trimmed_finish else accept_len


def compute_committed_after_result(cell: Cell, committed: int, run_len: int, stale: bool,
                                   finished: bool) -> int:
    """kv_committed_len after one decode result (digest 2.12), the settle-once rule (KV8).

    ``run_len`` is the committed run (compute_committed_run):
    - non-spec: unchanged (claimed at prepare time);
    - spec, pre-claim off (PR 28754): live += run_len; stale: unchanged;
    - spec, pre-claim on (PR 23456): live += run_len - 1; finished: -1 (refund);
      retracted: unchanged (reset_for_retract zeroed it).
    """
    if not cell.is_spec:
        return committed
    if not cell.preclaim:
        return committed if stale else committed + run_len
    if stale:
        return committed - 1 if finished else committed
    return committed + run_len - 1


def compute_cached_len(cell: Cell, committed: int, prompt_len: int, output_len: int,
                       aborted: bool) -> int:
    """What a finish release hands the tree cache (``Req.owned_kv_len``).

    The release: ``kv_committed_len`` cut at prompt + the visible output (``finished_len``:
    tokens committed past the stop or the cap are not keyed), the newest token included;
    an abort sets no ``finished_len``, so all of ``kv_committed_len``. The
    ``trimmed_finish`` proposal: never past the last token with KV, prompt + output - 1
    (prompt, when a cap of 0 trimmed the prefill's token from view).
    """
    if cell.trimmed_finish:
        return min(committed, prompt_len + max(output_len, 1) - 1)
    if aborted:
        return committed
    return min(committed, prompt_len + output_len)


def compute_inserted_len(cell: Cell, handed: int) -> int:
    """Positions of the ``handed`` length (compute_cached_len) the tree keeps; the release
    frees the rest, the partial page included (``release_kv_cache``, common.py:421-438).

    ``checkpoint_into_tree`` keys ``full_untruncated_fill_ids[:up_to]``
    (unified_radix_cache.py:1170), as bigrams under EAGLE, one shorter (``RadixKey.__len__``,
    radix_cache.py:96-100; every spec cell is EAGLE), cut to whole pages (``page_aligned``,
    radix_cache.py:147-151; unified_radix_cache.py:1232-1234): ``floor_p(handed - 1)`` or
    ``floor_p(handed)``. The fill ids (prompt + every output token) are never shorter than
    ``kv_committed_len`` >= ``handed``, so their cut does not bind.
    """
    key_len = max(handed - 1, 0) if cell.is_spec else handed
    return key_len // cell.page_size * cell.page_size


def compute_first_own_page(cache_protected_len: int, matched_len: int, page_size: int,
                           faults: frozenset[str] = frozenset()) -> int:
    """The first page a radix cell's release frees (common.py ``release_kv_cache``): the
    request's own start at ``cache_protected_len``. B27 frees from 0 (#32170, #11351), B28
    from the admission's match, not the prefix a checkpoint advanced since (#13714)."""
    start = (0 if "B27" in faults else matched_len if "B28" in faults
             else cache_protected_len)
    return start // page_size


def compute_committed_lead(cell: Cell, inflight_steps: int) -> int:
    """How far kv_committed_len runs ahead of the settled truth (KV8, KV10).

    Non-spec decode claims its slot at prepare time and the J2-era spec pre-claim
    claims the bonus at prepare time: one position per launched, unprocessed step.
    Spec with the pre-claim off (PR 28754) is honest: no lead.
    """
    if cell.is_spec and not cell.preclaim:
        return 0
    return inflight_steps


def compute_ns_expected_seq_len(prompt_len: int, output_len: int, claimed_steps: int) -> int:
    """SL7: after a non-spec prepare_for_decode, seq_lens = prompt + output + k.

    ``claimed_steps`` counts the step just prepared and the launched ones whose token
    is not yet in output_ids; k = claimed_steps - 1: 1 under overlap in the steady
    state (the previous batch is in flight), 0 without overlap.
    """
    return prompt_len + output_len + claimed_steps - 1


def compute_host_sync_budget(cell: Cell) -> int:
    """ST3: host-blocking syncs one iteration may make (digest section 6 table)."""
    if not cell.is_spec:
        return 1
    if cell.overlap and not cell.needs_cpu_seq_lens:
        return 1
    return 2


KV_WRITER_EPOCH_STRIDE = 1 << 16  # request ids stay below it (compute_kv_writer asserts)


def compute_kv_writer(rid: int, epoch: int) -> int:
    """Whom a forward's KV write names (``RequestState.kv_contents``, KV14): the request
    id, plus ``epoch`` strides after each retraction, so that a page the request gets back
    after a retraction does not pass for one written in its new holding."""
    assert 0 <= rid < KV_WRITER_EPOCH_STRIDE, f"request id {rid} out of the writer's range"
    return rid + epoch * KV_WRITER_EPOCH_STRIDE
