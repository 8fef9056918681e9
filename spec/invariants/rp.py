"""RP: result processing. A result arrives one iteration late under overlap: it must not
touch a request that finished or was retracted since, and what it keeps (accept lengths,
output tokens, finish reasons, metrics) is the environment's."""

from overlap_spec.spec import transitions as tr
from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.invariants.registry import fail, invariant
from overlap_spec.spec.state import (
    EOS_TOKEN,
    REFUSED_PROMPT_TOKEN,
    Observation,
    ObservationPoint,
    compute_env_token,
)


@invariant("RP1", overlap=True)
def check_rp1(config: ModelConfig, obs: Observation) -> int:
    """stale results change nothing

    a request finished or retracted when its late result is processed gets no output and no
    committed change, except the pre-claim refund.

    Source: PR 23456.
    """
    launch = obs.launch
    if obs.point is ObservationPoint.LAUNCH and launch is not None:
        for m in launch.members:
            if not m.holds_kv:
                raise fail("RP1", obs, f"for request r{m.rid}: launched after its KV was "
                           "released (finished or retracted before launch)")
    result = obs.result
    if result is None:
        return 0
    stale = [e for e in result.entries if e.stale]
    for e in stale:
        # The refund is a decode's (a spec decode result is the metered kind): a request
        # aborted for want of memory with its prefill result in flight gets none.
        refund = 1 if (config.cell.is_spec and config.cell.preclaim and e.finished_before
                       and result.metered) else 0
        if e.output_after != e.output_before or e.committed_after != e.committed_before - refund:
            raise fail("RP1", obs, f"for stale request r{e.rid}: output {e.output_before}->"
                       f"{e.output_after}, kv_committed_len {e.committed_before}->"
                       f"{e.committed_after}, expected unchanged"
                       + (" but for the -1 refund" if refund else ""))
    return len(stale)


@invariant("RP2")
def check_rp2(config: ModelConfig, obs: Observation) -> int:
    """accept length and output in range

    1 <= accept_len <= stride, the kept run is no longer than accept_len, and output_ids is what
    the environment emitted, within max_new_tokens (at a cap of 0 the prefill's token stays only
    when an abort ends the request).

    Source: batch_result_processor.py _resolve_spec_v2_tokens, schedule_batch.py
    update_finish_state.
    """
    count = 0
    for r in obs.requests:
        # A prefill's first token comes before any finish check; at a cap of 0 it stays
        # visible only when an abort ends the request (a length or stop finish trims it).
        limit = (r.max_new_tokens if r.finish_reason in ("length", "stop")
                 else max(r.max_new_tokens, 1))
        if r.output_len > limit:
            raise fail("RP2", obs, f"for request r{r.rid}: {r.output_len} output tokens > "
                       f"max_new_tokens={r.max_new_tokens}")
        if r.is_live and r.output_len != r.ghost.output_len_true:
            raise fail("RP2", obs, f"for request r{r.rid}: output_ids has {r.output_len} "
                       f"tokens, the environment emitted {r.ghost.output_len_true}")
        if r.finished and not r.ghost.finished:
            raise fail("RP2", obs, f"for request r{r.rid}: finished with {r.output_len} "
                       "tokens before EOS, max_new_tokens or an abort")
        count += 1 if r.output_len else 0
    result = obs.result
    if result is None:
        return count
    for e in result.entries:
        if not 1 <= e.accept_len <= min(e.stride, config.max_accept_len):
            raise fail("RP2", obs, f"for request r{e.rid}: accept_len={e.accept_len} outside "
                       f"[1, {min(e.stride, config.max_accept_len)}]")
        if not 0 <= e.run_len <= e.accept_len:
            raise fail("RP2", obs, f"for request r{e.rid}: run of {e.run_len} tokens > "
                       f"accept_len={e.accept_len}")
        if not e.stale and e.output_after - e.output_before != e.run_len:
            raise fail("RP2", obs, f"for request r{e.rid}: a kept run of {e.run_len} "
                       f"tokens grew output_ids by {e.output_after - e.output_before}")
    return count + len(result.entries)


@invariant("RP3", is_spec=True)
def check_rp3(config: ModelConfig, obs: Observation) -> int:
    """metrics count live requests only

    global accept counters count only requests live at processing time, in a result that feeds
    them (a prefill result feeds none and reports (0, 0)); upstream still counts all (mutant
    B4).

    Source: PR 18848, 23456 review.
    """
    result = obs.result
    if result is None:
        return 0
    if not result.metered:
        if (result.num_correct_drafts, result.metrics_batch_size) != (0, 0):
            raise fail("RP3", obs, f"the result of step {result.step} feeds no spec metrics "
                       f"but reports num_correct_drafts={result.num_correct_drafts}, batch "
                       f"size {result.metrics_batch_size}")
        return 0
    live = [e for e in result.entries if not e.stale]
    expected_correct = sum(e.accept_len - 1 for e in live)
    if result.num_correct_drafts != expected_correct or result.metrics_batch_size != len(live):
        raise fail("RP3", obs, f"for the result of step {result.step}: num_correct_drafts="
                   f"{result.num_correct_drafts}, batch size {result.metrics_batch_size}; "
                   f"live requests give {expected_correct} and {len(live)}")
    return len(result.entries)


@invariant("RP4", overshoot=False)
def check_rp4(config: ModelConfig, obs: Observation) -> int:
    """no launch past a length finish in flight

    a launch carries no request that its results in flight already finish by length: processed
    output tokens + results in flight < max_new_tokens, or 1 where a refused prompt's cap is 0
    (every result but a middle chunk's commits at least one). The release leaves such a request
    out of the decode; the overshoot era decoded it once more (#24590), so the claim is n/a in
    its cells.

    Source: scheduler.py ``_reqs_finishing_inflight``, ``enable_skip_finishing_decode``.
    """
    launch = obs.launch
    if obs.point is not ObservationPoint.LAUNCH or launch is None:
        return 0
    for m in launch.members:
        r = obs.get_request(m.rid)
        # The launched step itself is counted, and middle chunks in flight (the ghost's, this
        # one's included once forwarded) carry no token. A mixed batch's decode rows write
        # one token; its prefill rows none (from seq_len on).
        middle_now = (launch.forward_mode != "decode" and m.write_width == 0
                      and r.extend_end < r.prompt_len + r.output_len)
        in_flight = r.ghost.inflight_steps - 1 - (r.ghost.middle_chunks - middle_now)
        if r.output_len + in_flight >= max(r.max_new_tokens, 1):  # a first token, always
            raise fail("RP4", obs, f"for request r{r.rid}: launched with {r.output_len} "
                       f"output tokens and {in_flight} result(s) in flight, which already "
                       f"reach max_new_tokens={r.max_new_tokens}")
    return len(launch.members)


@invariant("RP5")
def check_rp5(config: ModelConfig, obs: Observation) -> int:
    """finish reason and output are the environment's

    a finished request ended for the environment's reason, with its output: abort if one was
    requested before the result that ended it, else stop if the stop token falls inside the kept
    run (one past the cap is a length finish), else length; and its visible output is what the
    environment emitted.

    Source: schedule_batch.py ``Req.update_finish_state``,
    ``_cap_finished_len_at_max_new_tokens``.
    """
    finished = [r for r in obs.requests if r.finished or r.finish_reason is not None]
    for r in finished:
        truth = (r.ghost.finish_reason, r.ghost.output_len_true) if r.finished else (None, "-")
        if (r.finish_reason, r.output_len if r.finished else "-") != truth:
            raise fail("RP5", obs, f"for request r{r.rid}: finished ({r.finish_reason}) with "
                       f"{r.output_len} visible output tokens, the environment ended it "
                       f"({truth[0]}) with {truth[1]}")
    return len(finished)


@invariant("RP6", is_spec=True)
def check_rp6(config: ModelConfig, obs: Observation) -> int:
    """per-request spec metrics count live verifies only

    a request's spec_verify_ct and spec_num_correct_drafts count only the verify results
    processed while it was live (their number, and their accept_len - 1): a stale row adds
    nothing.

    Source: batch_result_processor.py ``_resolve_spec_v2_tokens``.
    """
    for r in obs.requests:
        if (r.spec_verify_ct, r.spec_num_correct_drafts) != (r.ghost.verify_ct,
                                                               r.ghost.correct_drafts):
            raise fail("RP6", obs, f"for request r{r.rid}: spec_verify_ct={r.spec_verify_ct}"
                       f", spec_num_correct_drafts={r.spec_num_correct_drafts}; its live "
                       f"verifies were {r.ghost.verify_ct} with {r.ghost.correct_drafts} "
                       "accepted drafts")
    return sum(1 for r in obs.requests if r.ghost.verify_ct)


@invariant("RP7")
def check_rp7(config: ModelConfig, obs: Observation) -> int:
    """output tokens are the environment's, in order

    output_ids are the environment's tokens, in order: token i is the stand-in model's token at
    position prompt_len + i after token i - 1 (after the prompt's last for i = 0), or EOS as the
    last token; checked for the last token at every point, the tokens a result appended and
    every token at the end of an iteration. The model reads its input token from the relay under
    overlap, so a relayed sampled / bonus token that is not the one produced shows in the run
    after it.

    Source: schedule_batch.py ``output_ids``, overlap_utils.py ``resolve_forward_inputs``.
    """
    appended = {e.rid: e.output_before for e in obs.result.entries
                if not e.stale} if obs.result is not None else {}
    whole = obs.point is ObservationPoint.ITERATION_END
    count = 0
    for r in obs.requests:
        out, previous = r.output_ids, r.last_prompt_token
        if not out or previous is None:
            continue  # no output yet, or the values are not shown (a trace without them)
        start = 0 if whole else max(0, min(appended.get(r.rid, len(out) - 1), len(out) - 1))
        if start:
            previous = out[start - 1]
        for i, token in enumerate(out[start:], start):
            expected = compute_env_token(r.rid, r.prompt_len + i, previous)
            if token != expected and not (token == EOS_TOKEN and i == len(out) - 1):
                raise fail("RP7", obs, f"for request r{r.rid}: output token {i} is {token}; "
                           f"the environment emitted {expected} at position "
                           f"{r.prompt_len + i} after {previous}"
                           + (" (EOS only ends the output)" if token == EOS_TOKEN else ""))
            previous = token
        count += len(out) - start
    return count


@invariant("RP8", is_spec=False)
def check_rp8(config: ModelConfig, obs: Observation) -> int:
    """a prefill-only batch generates nothing

    a batch flagged prefill-only (the release never decodes it) holds only requests capped to 0
    new tokens; a request with tokens to generate in it would wait for a merge that may never
    come. The flag is the AND of its members' at prepare and merge, and a mixed step clears it
    (``mix_with_running``, #10889). Witnessed by each batch holding a request capped to 0, where
    the flag can be set.

    Source: schedule_batch.py ``is_prefill_only``, scheduler.py ``get_next_batch_to_run``.
    """
    count = 0
    for batch in obs.get_schedule_batches():
        capped = [obs.get_request(rid).max_new_tokens == 0 for rid in batch.rids]
        if batch.is_prefill_only and not all(capped):
            rid = batch.rids[capped.index(False)]
            raise fail("RP8", obs, f"for request r{rid}: max_new_tokens="
                       f"{obs.get_request(rid).max_new_tokens} in a {batch.forward_mode} "
                       "batch flagged prefill-only, which is never decoded")
        count += any(capped)
    return count


@invariant("RP9")
def check_rp9(config: ModelConfig, obs: Observation) -> int:
    """no refused prompt runs

    no request holds KV for a prompt the release refuses (max_req_len - 5 tokens or more):
    ``validate_input_length`` refuses it and ``set_finish_with_abort`` queues it as one token
    with an abort, so only that one-token stand-in may run (a trace that shows no prompt token
    is given the benefit of the doubt there). Witnessed by each request holding KV.

    Source: scheduler.py ``validate_input_length``, #3910, #9599.
    """
    holding = obs.get_holding()
    for r in holding:
        refused = tr.compute_admission(r.prompt_len, 1, config.preset.max_context_len,
                                    config.kv_tokens, config.page_size)[1]
        stand_in = r.prompt_len == 1 and r.last_prompt_token in (None, REFUSED_PROMPT_TOKEN)
        if refused and not stand_in:
            raise fail("RP9", obs, f"for request r{r.rid}: a prompt of {r.prompt_len} "
                       f"tokens holds KV, where validate_input_length refuses it")
    return len(holding)


@invariant("RP10")
def check_rp10(config: ModelConfig, obs: Observation) -> int:
    """one place per request

    at the end of an iteration every unfinished request is in exactly one place, once: the
    waiting queue (a retracted one too), the running batch, the last batch while it waits for
    its merge (an extend or mixed batch that is not the running batch, less the chunked
    request; the next get_next_batch_to_run merges it) or the chunked slot (its chunk's batch
    and result are the last batch and what is in flight, not a second place). A finished
    request is in no waiting queue; it may stay in the running or the last batch, or in
    flight, until the next step's filter_batch, so "finished in none" holds only past that
    filter, not at the end of an iteration, where RP10 looks. What is in flight is the last
    batch's.
    Witnessed by each unfinished request.

    Source: scheduler.py ``event_loop_overlap`` (``last_batch``, ``result_queue``),
    ``get_next_batch_to_run`` (``reqs_to_exclude``, the merge, the filter),
    ``update_running_batch`` (the retracted re-queued: ``_add_request_to_queue``).
    """
    p = obs.placement
    if obs.point is not ObservationPoint.ITERATION_END or p is None:
        return 0
    merging = p.last_mode in ("extend", "mixed") and not p.last_is_running
    places = {"the waiting queue": p.waiting, "the running batch": p.running,
              "the last batch": [r for r in p.last if merging and r != obs.chunked_rid],
              "the chunked slot": [r for r in [obs.chunked_rid] if r is not None]}
    for rid in {rid for batch in p.in_flight for rid in batch} - set(p.last):
        raise fail("RP10", obs, f"for request r{rid}: in flight, not in the last batch")
    for r in obs.requests:
        found = [name for name, rids in places.items() for rid in rids if rid == r.rid]
        if "the waiting queue" in found if r.finished else len(found) != 1:
            state = f"finished ({r.finish_reason})" if r.finished else "unfinished"
            raise fail("RP10", obs, f"for request r{r.rid}: {state} and in {len(found)} places "
                       f"({', '.join(found) or 'none'}), expected "
                       + ("not the waiting queue" if r.finished else "one"))
    return sum(not r.finished for r in obs.requests)
