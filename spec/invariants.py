"""The invariants, one predicate per ID of digest section 4.

Each ``check_*`` takes the model configuration and one :class:`Observation`,
raises :class:`InvariantViolation` naming the ID, the request and both values
when the claim is false, and otherwise returns how many instances it checked at
this observation (0 means the observation did not exercise it). Whether an ID
applies to a cell at all is ``Invariant.applies``; where it does not, reports
say "n/a".

Families: SL (sequence-length mirror), KV (KV accounting), FM (FutureMap relay),
ST (stream ordering), RP (result processing).

``INVARIANTS`` is a tuple of :class:`Invariant` (ID, one-line claim, upstream source,
``applies``, ``check``) in definition order, the order checkers report them in; for the
claims by ID use ``INVARIANTS_BY_ID`` (a mapping from ID to :class:`Invariant`) or
``get_invariant(ID)``, which names the known IDs when given an unknown one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from overlap_spec.spec.config import Cell, ModelConfig
from overlap_spec.spec.happens_before import FORWARD, SCHEDULE, Race
from overlap_spec.spec.state import (
    EOS_TOKEN,
    REFUSED_PROMPT_TOKEN,
    SCHEDULE_SIDE_POINTS,
    AllocatorView,
    BatchView,
    GhostView,
    Observation,
    ObservationPoint,
    RequestView,
    compute_env_token,
)
from overlap_spec.spec.transitions import (
    CLIP_MAX_NEW_TOKENS,
    compute_admission,
    compute_committed_lead,
    compute_host_sync_budget,
    compute_ns_expected_seq_len,
    compute_page_align_up,
    compute_pages_for_len,
)


class InvariantViolation(AssertionError):
    """A checked claim is false. ``str()`` reads like the report line."""

    def __init__(self, invariant_id: str, message: str,
                 all_ids: tuple[str, ...] = ()) -> None:
        super().__init__(f"{invariant_id} violated {message}")
        self.invariant_id = invariant_id
        self.message = message
        self.all_ids = all_ids or (invariant_id,)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its fields, so a violation crosses a process boundary intact.
        return (type(self), (self.invariant_id, self.message, self.all_ids), self.__dict__)


def fail(invariant_id: str, obs: Observation, message: str) -> InvariantViolation:
    return InvariantViolation(invariant_id, f"{message} at {obs.point.value}")


Check = Callable[[ModelConfig, Observation], int]


@dataclass(frozen=True)
class Invariant:
    id: str
    claim: str
    source: str
    applies: Callable[[Cell], bool]
    check: Check


def _always(cell: Cell) -> bool:
    return True


def _spec(cell: Cell) -> bool:
    return cell.is_spec


def _non_spec(cell: Cell) -> bool:
    return not cell.is_spec


def _spec_overlap(cell: Cell) -> bool:
    return cell.is_spec and cell.overlap


def _spec_overlap_no_mirror(cell: Cell) -> bool:
    return cell.is_spec and cell.overlap and not cell.needs_cpu_seq_lens


def _preclaim(cell: Cell) -> bool:
    return cell.is_spec and cell.preclaim


def _overlap(cell: Cell) -> bool:
    return cell.overlap


def _no_overshoot(cell: Cell) -> bool:
    return not cell.overshoot


_REGISTERED: list[Invariant] = []


def invariant(invariant_id: str, claim: str, source: str,
              applies: Callable[[Cell], bool] = _always) -> Callable[[Check], Check]:
    """Registers the predicate it decorates under its ID (INVARIANTS: definition order)."""
    def register(check: Check) -> Check:
        _REGISTERED.append(Invariant(invariant_id, claim, source, applies, check))
        return check
    return register


def _holding(obs: Observation) -> Iterable[RequestView]:
    return (r for r in obs.requests if r.holds_kv)


def _settling(obs: Observation) -> Iterable[RequestView]:
    """Live requests whose prefill result is processed: they have settled something."""
    return (r for r in obs.requests if r.is_live and not r.ghost.extend_inflight)


def _is_mid_prefill(r: RequestView) -> bool:
    """Its prefill is not done (a chunked request's). A call trace carries no ghost (a
    stand-in that raises on any read): there a request with no output at all (an abort
    after a prefill keeps its token)."""
    return r.ghost.extend_inflight if isinstance(r.ghost, GhostView) else r.output_len == 0


def _schedule_batches(obs: Observation) -> list[BatchView]:
    views: list[BatchView] = []
    if obs.point in SCHEDULE_SIDE_POINTS and obs.batch is not None:
        views.append(obs.batch)
    if obs.forward is not None:
        views.append(obs.forward.schedule_batch)
    return views


# ---------------------------------------------------------------- SL: mirror
@invariant("SL1", "init_new sum matches seq_lens_cpu", "forward_batch_info.py")
def check_sl1(config: ModelConfig, obs: Observation) -> int:
    """SL1: at init_new, FB.seq_lens_cpu is None or FB.seq_lens_sum == sum(FB.seq_lens_cpu)
    with matching lengths (forward_batch_info.py init_new, PR 25818)."""
    fb = obs.forward
    if fb is None or fb.seq_lens_cpu is None:
        return 0
    if fb.seq_lens_sum != sum(fb.seq_lens_cpu):
        raise fail("SL1", obs, f"for the {fb.purpose} ForwardBatch: seq_lens_sum="
                   f"{fb.seq_lens_sum} != sum(seq_lens_cpu)={sum(fb.seq_lens_cpu)}")
    if not len(fb.seq_lens_cpu) == len(fb.seq_lens) == fb.batch_size:
        raise fail("SL1", obs, f"for the {fb.purpose} ForwardBatch: len(seq_lens_cpu)="
                   f"{len(fb.seq_lens_cpu)}, len(seq_lens)={len(fb.seq_lens)}, "
                   f"batch_size={fb.batch_size}")
    return 1


@invariant("SL2", "GPU seq_lens mirrors seq_lens_cpu", "schedule_batch.py #26020")
def check_sl2(config: ModelConfig, obs: Observation) -> int:
    """SL2: wherever SB.seq_lens_cpu is present, SB.seq_lens equals it elementwise
    (schedule_batch.py, PR 26020 mirror)."""
    count = 0
    for batch in _schedule_batches(obs):
        if batch.seq_lens_cpu is None:
            continue
        for j, (gpu, cpu) in enumerate(zip(batch.seq_lens, batch.seq_lens_cpu, strict=False)):
            if gpu != cpu:
                raise fail("SL2", obs, f"for request r{batch.rids[j]}: seq_lens={gpu} "
                           f"!= seq_lens_cpu={cpu}")
        count += 1
    return count


@invariant("SL3", "seq_lens_sum is None or the sum", "schedule_batch.py #25818")
def check_sl3(config: ModelConfig, obs: Observation) -> int:
    """SL3: SB.seq_lens_sum is None or equals sum(SB.seq_lens_cpu) (PR 25818 lazy sum)."""
    count = 0
    for batch in _schedule_batches(obs):
        if batch.seq_lens_sum is None:
            continue
        if batch.seq_lens_cpu is None:
            raise fail("SL3", obs, f"for the batch: seq_lens_sum={batch.seq_lens_sum} "
                       "while seq_lens_cpu is None")
        if batch.seq_lens_sum != sum(batch.seq_lens_cpu):
            raise fail("SL3", obs, f"for the batch: seq_lens_sum={batch.seq_lens_sum} "
                       f"!= sum(seq_lens_cpu)={sum(batch.seq_lens_cpu)}")
        count += 1
    return count


@invariant("SL4", "batch fields share one length", "schedule_batch.py")
def check_sl4(config: ModelConfig, obs: Observation) -> int:
    """SL4: in a batch holding requests, reqs, seq_lens, req_pool_indices(_cpu) and
    seq_lens_cpu have one length, and spec_info.future_indices equals req_pool_indices;
    an emptied batch keeps stale tensors, never read (schedule_batch.py filter/merge; 0.5.23
    ``filter_batch``: callers check ``is_empty()``)."""
    reshaped = obs.point in (ObservationPoint.FILTER_BATCH, ObservationPoint.MERGE_BATCH,
                             ObservationPoint.RETRACT_DECODE)
    count = 0
    for batch in _schedule_batches(obs):
        if not batch.rids:
            continue
        lengths = {
            "reqs": len(batch.rids),
            "seq_lens": len(batch.seq_lens),
            "req_pool_indices": len(batch.req_pool_indices),
            "req_pool_indices_cpu": len(batch.req_pool_indices_cpu),
        }
        if batch.seq_lens_cpu is not None:
            lengths["seq_lens_cpu"] = len(batch.seq_lens_cpu)
        if len(set(lengths.values())) > 1:
            raise fail("SL4", obs, f"for the batch: lengths differ {lengths}")
        if batch.future_indices is not None and batch.future_indices != batch.req_pool_indices:
            raise fail("SL4", obs, f"for the batch: future_indices={list(batch.future_indices)}"
                       f" != req_pool_indices={list(batch.req_pool_indices)}")
        count += 1 if reshaped else 0
    return count


@invariant("SL5", "no sentinel seq_lens", "#25962 / #26020")
def check_sl5(config: ModelConfig, obs: Observation) -> int:
    """SL5: seq_lens is never a sentinel: >= 0, and >= 1 in decode (PR 25962, 26020)."""
    count = 0
    for batch in _schedule_batches(obs):
        floor = 1 if batch.forward_mode == "decode" else 0
        for rid, value in zip(batch.rids, batch.seq_lens, strict=False):
            if value < floor:
                raise fail("SL5", obs, f"for request r{rid}: seq_lens={value} < {floor}")
        count += 1
    fb = obs.forward
    if fb is not None:
        floor = 0 if fb.purpose == "extend" else 1
        for j, value in enumerate(fb.seq_lens):
            if value < floor:
                raise fail("SL5", obs, f"for row {j} of the {fb.purpose} ForwardBatch: "
                           f"seq_lens={value} < {floor}")
        count += 1
    return count


@invariant("SL6", "spec seq_lens at launch is the truth", "overlap_utils.py", _spec)
def check_sl6(config: ModelConfig, obs: Observation) -> int:
    """SL6: at a spec decode launch, SB.seq_lens[j] equals the latest published
    new_seq_lens of the request and its true KV length (overlap_utils.py resolve)."""
    launch = obs.launch
    if obs.point is not ObservationPoint.LAUNCH or launch is None:
        return 0
    if launch.forward_mode != "decode":
        return 0
    for m in launch.members:
        if m.published_seq_len is not None and m.seq_len != m.published_seq_len:
            raise fail("SL6", obs, f"for request r{m.rid}: seq_lens={m.seq_len} != "
                       f"new_seq_lens_buf={m.published_seq_len}")
        if m.seq_len != m.ghost_kv_len:
            raise fail("SL6", obs, f"for request r{m.rid}: seq_lens={m.seq_len} != "
                       f"true KV length={m.ghost_kv_len}")
    return len(launch.members)


@invariant("SL7", "non-spec decode seq_lens arithmetic", "schedule_batch.py", _non_spec)
def check_sl7(config: ModelConfig, obs: Observation) -> int:
    """SL7: after a non-spec prepare_for_decode, seq_lens == kv_committed_len ==
    kv_allocated_len == prompt + output + in-flight steps (schedule_batch.py)."""
    if obs.point is not ObservationPoint.PREPARE_FOR_DECODE or obs.batch is None:
        return 0
    for rid, seq_len in zip(obs.batch.rids, obs.batch.seq_lens, strict=False):
        r = obs.get_request(rid)
        expected = compute_ns_expected_seq_len(r.prompt_len, r.output_len,
                                               r.ghost.inflight_steps)
        if not seq_len == r.kv_committed_len == r.kv_allocated_len == expected:
            raise fail("SL7", obs, f"for request r{rid}: seq_lens={seq_len}, kv_committed_len="
                       f"{r.kv_committed_len}, kv_allocated_len={r.kv_allocated_len}, "
                       f"expected {expected}")
    return len(obs.batch.rids)


@invariant("SL8", "verify publishes s + accept_len", "eagle worker v2", _spec)
def check_sl8(config: ModelConfig, obs: Observation) -> int:
    """SL8: verify at seq_lens=s publishes s + accept_len with 1 <= accept_len <= max;
    extend publishes s (multi_layer_eagle_worker_v2.py on_publish)."""
    launch = obs.launch
    if obs.point is not ObservationPoint.RUN_BATCH or launch is None:
        return 0
    for p in launch.publishes:
        if p.accept_len is None:
            if p.value != p.seq_len_in:
                raise fail("SL8", obs, f"for request r{p.rid}: extend published {p.value} "
                           f"!= seq_lens={p.seq_len_in}")
            continue
        if not 1 <= p.accept_len <= config.max_accept_len:
            raise fail("SL8", obs, f"for request r{p.rid}: accept_len={p.accept_len} outside "
                       f"[1, {config.max_accept_len}]")
        if p.value != p.seq_len_in + p.accept_len:
            raise fail("SL8", obs, f"for request r{p.rid}: published {p.value} != seq_lens "
                       f"{p.seq_len_in} + accept_len {p.accept_len}")
    return len(launch.publishes)


def _mirror_fields(batch: BatchView) -> dict[str, object]:
    return {
        "forward_mode": batch.forward_mode,
        "reqs": batch.rids,
        "seq_lens": batch.seq_lens,
        "seq_lens_cpu": batch.seq_lens_cpu,
        "seq_lens_sum": batch.seq_lens_sum,
        "req_pool_indices": batch.req_pool_indices,
    }


@invariant("SL9", "run_batch isolation restores SB", "scheduler.py", _spec)
def check_sl9(config: ModelConfig, obs: Observation) -> int:
    """SL9: a spec run_batch leaves every SB field as it found it except input_ids and
    spec_info; without overlap it re-applies new_seq_lens consistently (scheduler.py)."""
    iso = obs.isolation
    if obs.point is not ObservationPoint.RUN_BATCH or iso is None:
        return 0
    before, after = _mirror_fields(iso.entry), _mirror_fields(iso.exit)
    if iso.reapplied_seq_lens is not None:
        new = iso.reapplied_seq_lens
        before["seq_lens"] = new
        if iso.entry.seq_lens_cpu is not None:
            before["seq_lens_cpu"] = new
            before["seq_lens_sum"] = sum(new)
    for name, value in before.items():
        if after[name] != value:
            raise fail("SL9", obs, f"for the batch field {name}: after run_batch {after[name]}"
                       f" != expected {value}")
    return 1


@invariant("SL10", "draft-extend mutation stays on FB", "eagle_info_v2.py #26020", _spec)
def check_sl10(config: ModelConfig, obs: Observation) -> int:
    """SL10: the draft-extend +D_tok lands on the ForwardBatch (seq_lens, cpu, sum) and
    never on the ScheduleBatch (eagle_info_v2.py, PR 26020)."""
    fb, iso = obs.forward, obs.isolation
    if obs.point is not ObservationPoint.DRAFT_EXTEND or fb is None or iso is None:
        return 0
    entry, sb = iso.entry, fb.schedule_batch
    # init_new may backfill a None SB.seq_lens_sum with the true sum (upstream does;
    # PR 32532 proposed not to). That is not a mutation of the mirror; anything else is.
    backfilled = (entry.seq_lens_sum is None and sb.seq_lens_cpu is not None
                  and sb.seq_lens_sum == sum(sb.seq_lens_cpu))
    for name in ("seq_lens", "seq_lens_cpu", "seq_lens_sum"):
        if name == "seq_lens_sum" and backfilled:
            continue
        if getattr(sb, name) != getattr(entry, name):
            raise fail("SL10", obs, f"for the batch: ScheduleBatch.{name}={getattr(sb, name)}"
                       f" changed from {getattr(entry, name)} inside the forward")
    # Stated here, not through compute_draft_extend_seq_lens (which the implementations
    # call): an expected value from the function under test cannot catch its mistake.
    rungs = {config.get_shape(steps).draft_tokens
             for steps in range(config.preset.chain_steps + 1)}
    if fb.draft_tokens not in rungs:
        raise fail("SL10", obs, f"for the draft-extend ForwardBatch: D_tok={fb.draft_tokens}"
                   f" is no rung's draft token count {sorted(rungs)}")
    expected = tuple(s + fb.draft_tokens for s in entry.seq_lens)
    if fb.seq_lens != expected:
        raise fail("SL10", obs, f"for the draft-extend ForwardBatch: seq_lens="
                   f"{list(fb.seq_lens)} != seq_lens + D_tok={list(expected)}")
    if fb.seq_lens_cpu is not None and (
        fb.seq_lens_cpu != expected or fb.seq_lens_sum != sum(expected)
    ):
        raise fail("SL10", obs, f"for the draft-extend ForwardBatch: seq_lens_cpu="
                   f"{fb.seq_lens_cpu}, seq_lens_sum={fb.seq_lens_sum}, expected "
                   f"{list(expected)} / {sum(expected)}")
    return 1


@invariant("SL11", "no host length without the mirror (#27979: an upper bound)",
           "PR 26128; #27979 (closed; not in 0.5.23)", _spec_overlap_no_mirror)
def check_sl11(config: ModelConfig, obs: Observation) -> int:
    """SL11: with no host mirror the release keeps no host length after a resolve
    (``seq_lens_cpu``, ``seq_lens_sum`` None: the no-D2H path of PR 26128); under the
    proposal that keeps one, seq_len_cpu_ub >= max(seq_lens) (the closed PR 27979)."""
    batch = obs.batch
    if obs.point is not ObservationPoint.RESOLVE_SEQ_LENS_CPU or batch is None:
        return 0
    if not config.cell.cpu_ub:
        if (batch.seq_lens_cpu, batch.seq_lens_sum, batch.seq_len_cpu_ub) != (None, None, None):
            raise fail("SL11", obs, f"for the batch: with no host mirror the host still holds "
                       f"lengths after resolve: seq_lens_cpu={batch.seq_lens_cpu}, seq_lens_sum="
                       f"{batch.seq_lens_sum}, seq_len_cpu_ub={batch.seq_len_cpu_ub} (the "
                       "release leaves all three None)")
        return 1
    if batch.seq_lens_cpu is not None or not batch.seq_lens:
        return 0
    top = max(batch.seq_lens)
    if batch.seq_len_cpu_ub is None or batch.seq_len_cpu_ub < top:
        raise fail("SL11", obs, f"for the batch: seq_len_cpu_ub={batch.seq_len_cpu_ub} < "
                   f"max(seq_lens)={top}")
    return 1


# ---------------------------------------------------------------- KV: accounting
@invariant("KV1", "committed <= allocated <= width", "schedule_batch.py #23456")
def check_kv1(config: ModelConfig, obs: Observation) -> int:
    """KV1: 0 <= kv_committed_len <= kv_allocated_len <= row width for every request
    holding KV: the model's row (widened to the decode reserve), or the narrower one an
    implementation built and says it built (B21, B23, the release's page-1 tree; a trace
    without the allocator is held to the model's) (schedule_batch.py, PR 23456)."""
    count = 0
    width = _get_row_width(config, obs)
    for r in _holding(obs):
        if not 0 <= r.kv_committed_len <= r.kv_allocated_len <= width:
            past = " (allocated past the row)" if r.kv_allocated_len > width else ""
            raise fail("KV1", obs, f"for request r{r.rid}: kv_committed_len="
                       f"{r.kv_committed_len}, kv_allocated_len={r.kv_allocated_len}, "
                       f"row width={width}{past}")
        count += 1
    return count


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


@invariant("KV2", "non-spec committed == allocated", "mem_cache/common.py", _non_spec)
def check_kv2(config: ModelConfig, obs: Observation) -> int:
    """KV2: without speculation kv_committed_len == kv_allocated_len (common.py release
    assertion)."""
    count = 0
    for r in _holding(obs):
        if r.kv_committed_len != r.kv_allocated_len:
            raise fail("KV2", obs, f"for request r{r.rid}: kv_committed_len="
                       f"{r.kv_committed_len} != kv_allocated_len={r.kv_allocated_len}")
        count += 1
    return count


@invariant("KV3", "2x reserve covers draft+verify", "eagle_info_v2.py", _spec)
def check_kv3(config: ModelConfig, obs: Observation) -> int:
    """KV3: at a spec decode launch kv_allocated_len >= true length + W, so draft and
    verify write only reserved positions, and on pages > 1 it ends on a page boundary, the
    paged allocator's whole-page footprint (eagle_info_v2.py 2x reserve;
    allocation_sizing.py page_aligned_decode_alloc_lens, #31616)."""
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


@invariant("KV4", "req_to_token rows own their slots", "memory_pool.py")
def check_kv4(config: ModelConfig, obs: Observation) -> int:
    """KV4: req_to_token[row, 0:kv_allocated_len] holds slots of pages the request owns,
    and no page has two owners (memory_pool.py ReqToTokenPool)."""
    owner: dict[int, int] = {}
    count = 0
    for r in _holding(obs):
        if len(r.row_slots) != r.kv_allocated_len:
            raise fail("KV4", obs, f"for request r{r.rid}: row holds {len(r.row_slots)} "
                       f"slots != kv_allocated_len={r.kv_allocated_len}"
                       f"{_past_the_row(config, obs)}")
        pages = set(r.owned_pages)
        needed = compute_pages_for_len(r.kv_allocated_len, obs.allocator.page_size)
        if len(pages) != needed:
            raise fail("KV4", obs, f"for request r{r.rid}: owns {len(pages)} pages but "
                       f"kv_allocated_len={r.kv_allocated_len} covers {needed} (stranded pages)")
        for page in pages:
            if page in owner:
                raise fail("KV4", obs, f"for request r{r.rid}: page {page} also owned by "
                           f"r{owner[page]}")
            owner[page] = r.rid
        for position, slot in enumerate(r.row_slots):
            if slot // obs.allocator.page_size not in pages:
                raise fail("KV4", obs, f"for request r{r.rid}: req_to_token position "
                           f"{position} holds slot {slot} outside its pages"
                           f"{_past_the_row(config, obs)}")
        count += 1
    if obs.launch is not None:
        for write in obs.launch.kv_write_faults:
            if write.reason != "beyond kv_allocated_len":
                raise fail("KV4", obs, f"for request r{write.rid}: forward wrote position "
                           f"{write.position} (slot {write.slot}): {write.reason}")
    return count


@invariant("KV5", "retracted requests hold nothing", "reset_for_retract")
def check_kv5(config: ModelConfig, obs: Observation) -> int:
    """KV5: a retracted request holds nothing: committed == allocated == 0, no pool row,
    waiting to be re-admitted (schedule_batch.py reset_for_retract)."""
    count = 0
    for r in obs.requests:
        if not r.is_retracted:
            continue
        if (r.kv_committed_len, r.kv_allocated_len) != (0, 0):
            raise fail("KV5", obs, f"for retracted request r{r.rid}: kv_committed_len="
                       f"{r.kv_committed_len}, kv_allocated_len={r.kv_allocated_len}, "
                       "expected 0 and 0")
        if r.req_pool_idx is not None or r.holds_kv or not r.waiting:
            raise fail("KV5", obs, f"for retracted request r{r.rid}: req_pool_idx="
                       f"{r.req_pool_idx}, holds_kv={r.holds_kv}, waiting={r.waiting}")
        count += 1
    return count


@invariant("KV6", "released once, no change after", "release_kv_cache")
def check_kv6(config: ModelConfig, obs: Observation) -> int:
    """KV6: KV is released once per holding, and after a finish release committed moves
    only by the pre-claim refunds (common.py release_kv_cache, PR 23456/28754)."""
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
        low, high = settled, r.committed_at_release
        if r.ghost.inflight_steps == 0:
            low = high = settled
        if not low <= r.kv_committed_len <= high:
            raise fail("KV6", obs, f"for request r{r.rid}: kv_committed_len="
                       f"{r.kv_committed_len} after release, expected in [{low}, {high}]")
        # Non-trivial under overlap once a late result arrived after the release.
        late = r.inflight_at_release > 0 and r.ghost.inflight_steps == 0
        count += 1 if (late or not config.cell.overlap) else 0
    return count


@invariant("KV7", "pages and rows conserved", "invariant_checker")
def check_kv7(config: ModelConfig, obs: Observation) -> int:
    """KV7: every KV page is free, in the tree cache or owned by one request, and every
    pool row is free or held by one request (invariant_checker._check_all_pools)."""
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


@invariant("KV8", "each step settles once", "batch_result_processor.py")
def check_kv8(config: ModelConfig, obs: Observation) -> int:
    """KV8: each processed step settles exactly once: committed == settled truth + the
    lead of unprocessed claimed steps, for a live request and, where the release commits
    the whole accepted run, at the finish release too (less the bonus slot when a spec
    decode mixed into a prefill finishes: that result commits nothing); an abort mid-chunk
    has committed what its chunks wrote (batch_result_processor.py, alloc_for_extend)."""
    if obs.point is not ObservationPoint.PROCESS_RESULT:
        return 0
    count = 0
    for r in _settling(obs):
        lead = compute_committed_lead(config.cell, r.ghost.inflight_steps)
        if r.kv_committed_len != r.ghost.settled_len + lead:
            raise fail("KV8", obs, f"for request r{r.rid}: kv_committed_len="
                       f"{r.kv_committed_len} != settled true length {r.ghost.settled_len}"
                       f" + in-flight lead {lead}")
        count += 1
    for r in obs.requests:
        if r.committed_at_release is None or config.cell.trimmed_finish:
            continue  # the trimmed finish commits less than it settled (KV9 says how much)
        lead = compute_committed_lead(config.cell, r.claimed_at_release)
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
        count += 1
    return count


@invariant("KV9", "committed matches output", "#24590 / #22897 / M2")
def check_kv9(config: ModelConfig, obs: Observation) -> int:
    """KV9: committed KV matches the output. A live spec request has committed - lead ==
    prompt + output - 1. At a finish the release has committed the whole accepted run
    (KV8 checks it against the settled truth) and caches ``owned_kv_len``: that cut at
    prompt + the visible output, all of it for an abort (no ``finished_len``); the
    trimmed finish commits and caches prompt + output - 1; an abort of the chunked request,
    its prefill pending, caches nothing (``_resolve_spec_v2_tokens``, ``Req.owned_kv_len``,
    ``process_pending_chunked_abort``; the proposal: #35694, #24590)."""
    count = 0
    if obs.point is ObservationPoint.PROCESS_RESULT and config.cell.is_spec:
        for r in _settling(obs):
            lead = compute_committed_lead(config.cell, r.ghost.inflight_steps)
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
        lead = compute_committed_lead(config.cell, r.claimed_at_release)
        # The newest token has no KV yet. A prefill's token trimmed from view (a cap of 0)
        # was sampled all the same: the prompt's KV is all there.
        with_kv = r.prompt_len + max(r.output_len, 1) - 1
        shown = r.prompt_len + r.output_len
        trimmed, aborted = config.cell.trimmed_finish, r.finish_reason == "abort"
        expected = with_kv if trimmed else committed if aborted else min(committed, shown)
        rule = ("prompt + output - 1 (trimmed finish)" if trimmed else
                "kv_committed_len (abort)" if aborted else "owned_kv_len")
        if aborted and _is_mid_prefill(r):  # mid-chunk: released, checkpoint=False
            expected, rule = 0, "nothing (a chunked request's abort)"
        if r.cached_len != expected:
            raise fail("KV9", obs, f"for request r{r.rid}: cached {r.cached_len} tokens at "
                       f"finish, expected {rule} = {expected} (prompt + visible output "
                       f"{shown}, committed {committed})")
        if trimmed and committed - lead != with_kv and not _is_mid_prefill(r):
            raise fail("KV9", obs, f"for request r{r.rid}: kv_committed_len={committed} - "
                       f"claimed lead {lead} at finish != prompt + output - 1 = {with_kv}")
        count += 1
    return count


def check_rp_output(config: ModelConfig, obs: Observation) -> int:
    """Shared by RP2: output_ids agrees with what the environment emitted, within budget."""
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
    return count


@invariant("KV10", "pre-claim inflation is the in-flight count", "#23456 (J2 era)", _preclaim)
def check_kv10(config: ModelConfig, obs: Observation) -> int:
    """KV10: with the bonus pre-claim, committed - settled truth == in-flight steps,
    0 or 1 (eagle_info.py J2 era, PR 23456)."""
    if obs.point is not ObservationPoint.PROCESS_RESULT:
        return 0
    count = 0
    for r in _settling(obs):
        inflation = r.kv_committed_len - r.ghost.settled_len
        if inflation != r.ghost.inflight_steps:
            raise fail("KV10", obs, f"for request r{r.rid}: kv_committed_len="
                       f"{r.kv_committed_len} - settled {r.ghost.settled_len} = {inflation}"
                       f" != in-flight steps {r.ghost.inflight_steps}")
        if not 0 <= r.ghost.inflight_steps <= 1:
            raise fail("KV10", obs, f"for request r{r.rid}: {r.ghost.inflight_steps} steps "
                       "in flight, expected 0 or 1")
        count += 1
    return count


@invariant("KV11", "admission within the release's running-total estimate",
           "schedule_policy.py PrefillAdder")
def check_kv11(config: ModelConfig, obs: Observation) -> int:
    """KV11: a prefill admits by the release's estimate of the running total: the chunked
    request's next chunk first (at most the chunk budget or, when positive and smaller, the
    budget left), then in queue order, each admitted request asks (fill + remaining
    max_new_tokens + a page) for less than the free KV less every running request's
    remaining max_new_tokens x new_token_ratio and what those admitted before it reserved
    (paged extend + a page + max_new_tokens unless cut into a first chunk); with chunked
    prefill each extend also spends the step's chunk budget, and a fill it cannot hold is cut
    to the budget's whole pages; admission stops at the first that does not fit, or when
    rows, budget or chunk budget run out. A mixed step first sets one token per running
    decode aside from the running total, the current total and the chunk budget, and a
    chunked request is never continued with no chunk budget left (the release would
    prefill an empty or negative chunk, ``extend_end <= prefix_len``; admissions keep the
    running requests below the chunk size while one is pending, and where PD-prebuilt
    arrivals fill it the chunk waits) (schedule_policy.py PrefillAdder, add_chunked_req,
    mem_cache/prefill_budget.py)."""
    view = obs.admission
    if view is None or obs.batch is None:
        return 0
    continued = view.continued
    admitted = tuple(rid for rid, *_ in view.waiting[:view.admitted])
    expected_rids = ((continued[0],) if continued else ()) + admitted
    if expected_rids != obs.batch.rids:
        raise fail("KV11", obs, f"for the prefill: it holds {list(obs.batch.rids)}, the "
                   f"admission admitted {list(expected_rids)}")
    page, clip, free = config.page_size, CLIP_MAX_NEW_TOKENS, view.available_tokens
    # Summed as PrefillBudget sums them (float rounding included): 0, the running estimate,
    # then each admission's reservation.
    # A mixed step sets one token per running decode aside first, from both budgets.
    mixed = view.mixed_decode_tokens
    total: float = mixed
    total += sum([min(max_new - out, clip) * view.new_token_ratio
                  for max_new, out in view.running])
    current, count = mixed, 0
    chunk = None if not view.chunk_size else view.chunk_size - mixed
    if continued is not None:
        rid, prefix, fill, max_new, end = continued
        assert chunk is not None
        if chunk <= 0:  # nothing of the chunk budget left: the chunk would be empty
            raise fail("KV11", obs, f"for request r{rid}: continued with {chunk} left of the "
                       f"chunk budget ({mixed} running decode(s) set aside): an empty chunk "
                       f"[{prefix}, {end})")
        room = min(chunk, int(free - total))  # available_chunk_tokens, not page-floored
        expected = prefix + min(fill - prefix, room if room > 0 else chunk)
        expected = min(expected, view.continued_limit or expected)  # the model's cap (U8)
        if end != expected:
            raise fail("KV11", obs, f"for request r{rid}: its next chunk ends at {end}, the "
                       f"chunk budget {chunk} from prefix {prefix} of {fill} says {expected}")
        paged = compute_page_align_up(end - prefix, page)
        total += paged + page + (min(max_new, clip) if end == fill else 0)
        current += paged + page
        chunk -= paged
        count += 1
    held = continued is not None
    for k, (rid, fill, max_new, out) in enumerate(view.waiting):
        asked = fill + min(max(max_new - out, 0), clip) + page
        fits = asked < free - total
        capacity = free - total > 0 and free - current > 0
        # A fill the chunk budget cannot hold is cut to its whole pages (none: OTHER).
        first = fill if chunk is None or -(-fill // page) * page <= chunk else chunk // page * page
        spent = capacity and first <= 0
        if k == view.admitted:
            if (not view.latched and k + held < view.rows and capacity and fits
                    and not spent):
                raise fail("KV11", obs, f"for request r{rid}: left waiting though it asks "
                           f"{asked} tokens < {free - total:.3f} left (free {free}, chunk "
                           f"budget {chunk})")
            return count + 1
        if view.latched or k + held >= view.rows or not fits or spent:
            raise fail("KV11", obs, f"for request r{rid}: admitted asking {asked} tokens, "
                       f"{free - total:.3f} left (free {free}, rows {view.rows}, chunk budget "
                       f"{chunk}, latched {view.latched})")
        end = view.ends[k]
        if end != first:
            raise fail("KV11", obs, f"for request r{rid}: its extend ends at {end} of {fill} "
                       f"with {chunk} left of the chunk budget")
        paged = compute_page_align_up(end, page)
        total += paged + page + (min(max_new, clip) if end == fill else 0)
        current += paged + page
        chunk = None if chunk is None else chunk - paged
        count += 1
    return count


@invariant("KV12", "one chunked prefill, committed to its chunk, kept out of decode",
           "scheduler.py chunked_req")
def check_kv12(config: ModelConfig, obs: Observation) -> int:
    """KV12: a prefill still pending is whole, or the scheduler's one chunked request's:
    committed and allocated to the end of its latest chunk, with at most one middle chunk
    in flight per launch the loop keeps queued (1 without overlap, 2 with), counted as the
    forward ran them (at an iteration's end, ``inflight_middle_chunks`` equals the middle
    chunks launched with results unprocessed), and in no decode batch until its last chunk
    is scheduled (scheduler.py chunked_req, stash_chunked_request,
    Req.inflight_middle_chunks, batch_result_processor.py)."""
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


# ---------------------------------------------------------------- FM / ST: streams
def classify_race(race: Race) -> str:
    """Which invariant an unsynchronised pair breaks, by buffer and streams."""
    buffer = race.later.key[0]
    if race.later.kind == "free" or race.earlier.kind == "free":
        return "ST4"
    if buffer in ("new_seq_lens_buf", "new_seq_lens_cpu_pinned"):
        return "FM1"
    if (race.later.kind == "read" and race.later.participant != FORWARD
            and race.earlier.participant == FORWARD):
        return "FM1"  # the rule behind FM1: forward-produced data only through the relay
    if buffer == "output_tokens_buf":
        return "FM3"
    if buffer == "result":
        return "ST5"
    if race.later.participant == FORWARD:
        return "ST1"
    return "ST2"


def _check_races(invariant_id: str, obs: Observation) -> int:
    """Fail on a race this claim owns; else the witnesses: the cross-participant access
    pairs of this claim whose order was checked since the previous observation."""
    mine = [race for race in obs.races if classify_race(race) == invariant_id]
    if mine:
        raise fail(invariant_id, obs, f"for buffer {mine[0].later.key[0]}"
                   f"[{mine[0].later.key[1]}]: {mine[0].describe()}")
    return sum(classify_race(pair) == invariant_id for pair in obs.checked_pairs)


@invariant("FM1", "publish before read", "overlap_utils.py publish_ready", _spec_overlap)
def check_fm1(config: ModelConfig, obs: Observation) -> int:
    """FM1: every schedule-side or D-side read of new_seq_lens_buf[p] happens after the
    forward's latest publish of p (overlap_utils.py publish_ready)."""
    return _check_races("FM1", obs)


@invariant("FM2", "publish_ready single capture covers publishes", "#30435 / #35748", _spec_overlap)
def check_fm2(config: ModelConfig, obs: Observation) -> int:
    """FM2: the latest capture of publish_ready covers every publish whose row is read
    (single capture point; PR 30435 / 35748)."""
    resolve = obs.resolve
    if resolve is None:
        return 0
    if resolve.uncovered_rows:
        raise fail("FM2", obs, f"for new_seq_lens_buf rows {list(resolve.uncovered_rows)}: "
                   "publish_ready was captured before their latest publish")
    return len(resolve.rows)


@invariant("FM3", "stash before gather", "overlap_utils.py stash", _overlap)
def check_fm3(config: ModelConfig, obs: Observation) -> int:
    """FM3: forward-only relay rows read at forward entry were stashed by an earlier
    forward on the same stream or by a seed ordered before it (overlap_utils.py stash)."""
    _check_races("FM3", obs)
    return len(obs.launch.relay_gathers) if obs.launch is not None else 0


@invariant("FM4", "consume-once relay rows", "#30471", _overlap)
def check_fm4(config: ModelConfig, obs: Observation) -> int:
    """FM4: between two gathers of output_tokens_buf[p] there is exactly one stash of p
    holding a token to consume; a middle chunk's, which its next chunk's overwrites, is
    none (consume-once, PR 30471)."""
    if obs.launch is None:
        return 0
    for g in obs.launch.relay_gathers:
        if g.stashes_since_last_gather != 1:
            raise fail("FM4", obs, f"for request r{g.rid}: output_tokens_buf[{g.row}] "
                       f"gathered after {g.stashes_since_last_gather} stashes, expected 1")
    return len(obs.launch.relay_gathers)


@invariant("FM5", "relay row belongs to its owner", "overlap_utils.py", _overlap)
def check_fm5(config: ModelConfig, obs: Observation) -> int:
    """FM5: a relay row is read only after its current owner seeded it: a prefill publish
    or stash (overlap_utils.py, req_pool_idx indexing); every row read is a request row,
    1..max_running_requests (0 is the padding row; a list would wrap a negative one)."""
    rows = range(1, config.preset.max_running_requests + 1)
    resolved = obs.resolve.rows if obs.resolve is not None else ()
    gathered = obs.launch.relay_gathers if obs.launch is not None else ()
    for row in (*resolved, *(g.row for g in gathered)):
        if row not in rows:
            raise fail("FM5", obs, f"relay row {row} read, outside the request rows "
                       f"1..{rows[-1]}")
    if obs.launch is None:
        return 0
    for g in obs.launch.relay_gathers:
        if not g.written_by_current_owner:
            raise fail("FM5", obs, f"for request r{g.rid}: output_tokens_buf[{g.row}] was "
                       "last written for a previous owner of the row")
    for rid, row in obs.launch.unseeded_spec_rows:
        raise fail("FM5", obs, f"for request r{rid}: new_seq_lens_buf[{row}] read before "
                   "its owner published it")
    return len(obs.launch.relay_gathers) + len(obs.launch.members)


@invariant("FM6", "publish_ready consumed once", "#30471 (_publish_fresh)", _spec_overlap)
def check_fm6(config: ModelConfig, obs: Observation) -> int:
    """FM6: each resolve that waits on publish_ready consumes a publish recorded since the
    previous resolve (consume-once; overlap_utils.py _publish_fresh, PR 30471)."""
    resolve = obs.resolve
    if resolve is None or resolve.fresh_publish is None:
        return 0
    if not resolve.fresh_publish:
        raise fail("FM6", obs, "resolve_seq_lens_cpu waited on a publish_ready that no "
                   "publish re-armed since the previous resolve consumed it")
    return 1


@invariant("FM7", "resolved rows re-published first", "#30471 (-1 poison)", _spec_overlap)
def check_fm7(config: ModelConfig, obs: Observation) -> int:
    """FM7: a resolve gathers a new_seq_lens_buf row only if it was published since the
    previous resolve gathered it (upstream's CI poisons gathered rows with -1 and asserts
    non-negative values; overlap_utils.py _assert_nonneg_and_invalidate, PR 30471)."""
    resolve = obs.resolve
    if resolve is None:
        return 0
    if resolve.regathered_rows:
        raise fail("FM7", obs, f"for new_seq_lens_buf rows {list(resolve.regathered_rows)}: "
                   "gathered again with no publish since the previous resolve consumed them "
                   "(upstream's CI would read the -1 poison)")
    return len(resolve.rows)


@invariant("ST1", "RAW: F waits for S at launch", "scheduler.py run_batch", _overlap)
def check_st1(config: ModelConfig, obs: Observation) -> int:
    """ST1: the forward reads schedule-produced tensors only after F.wait_stream(S)
    (scheduler.py run_batch)."""
    return _check_races("ST1", obs)


@invariant("ST2", "WAR: S writes after F reads", "_apply_war_barrier #31687", _overlap)
def check_st2(config: ModelConfig, obs: Observation) -> int:
    """ST2: schedule-side writes to req_to_token after launching B_i are ordered after
    F_i's reads (scheduler.py _apply_war_barrier, PR 26380 / 31687)."""
    return _check_races("ST2", obs)


@invariant("ST3", "host blocks only on D2H and copy_done", "#26380 / #26463")
def check_st3(config: ModelConfig, obs: Observation) -> int:
    """ST3: one iteration blocks the host at most on the private D2H and copy_done, never
    on the schedule stream under overlap (PR 26380 / 26463)."""
    if obs.host_syncs is None:
        return 0
    if config.cell.overlap and f"stream:{SCHEDULE}" in obs.host_syncs:
        raise fail("ST3", obs, "for the iteration: a host sync on the schedule stream, which "
                   f"the WAR fence chains to the whole forward (syncs: {list(obs.host_syncs)})")
    budget = compute_host_sync_budget(config.cell)
    if len(obs.host_syncs) > budget:
        raise fail("ST3", obs, f"for the iteration: {len(obs.host_syncs)} host syncs > "
                   f"budget {budget} ({list(obs.host_syncs)})")
    return 1 if obs.launched_this_iteration else 0


@invariant("ST4", "tensors live until F completes", "batch_record_buf", _overlap)
def check_st4(config: ModelConfig, obs: Observation) -> int:
    """ST4: a schedule-produced tensor read by F_i stays referenced until F_i completed
    (scheduler.py batch_record_buf two-slot ring)."""
    return _check_races("ST4", obs)


@invariant("ST5", "results FIFO, once, after copy_done", "result_queue")
def check_st5(config: ModelConfig, obs: Observation) -> int:
    """ST5: results are processed in launch order, once, after copy_done, with at most
    one pending under overlap (scheduler.py result_queue)."""
    _check_races("ST5", obs)
    result = obs.result
    if result is None:
        return 0
    if result.previous_step is not None and result.step <= result.previous_step:
        raise fail("ST5", obs, f"for result of step {result.step}: processed after step "
                   f"{result.previous_step}")
    limit = 1 if config.cell.overlap else 0
    if result.pending_after > limit:
        raise fail("ST5", obs, f"for the result queue: {result.pending_after} pending after "
                   f"processing, limit {limit}")
    return 1


# ---------------------------------------------------------------- RP: results
@invariant("RP1", "stale results change nothing", "#23456", _overlap)
def check_rp1(config: ModelConfig, obs: Observation) -> int:
    """RP1: a request finished or retracted when its late result is processed gets no
    output and no committed change, except the pre-claim refund (PR 23456)."""
    launch = obs.launch
    if obs.point is ObservationPoint.LAUNCH and launch is not None:
        for m in launch.members:
            if not m.holds_kv:
                raise fail("RP1", obs, f"for request r{m.rid}: launched after its KV was "
                           "released (finished or retracted before launch)")
    result = obs.result
    if result is None:
        return 0
    count = 0
    for e in result.entries:
        if not e.stale:
            continue
        # The refund is a decode's (a spec decode result is the metered kind): a request
        # aborted for want of memory with its prefill result in flight gets none.
        refund = 1 if (config.cell.is_spec and config.cell.preclaim and e.finished_before
                       and result.metered) else 0
        if e.output_after != e.output_before or e.committed_after != e.committed_before - refund:
            raise fail("RP1", obs, f"for stale request r{e.rid}: output {e.output_before}->"
                       f"{e.output_after}, kv_committed_len {e.committed_before}->"
                       f"{e.committed_after}, expected unchanged"
                       + (" but for the -1 refund" if refund else ""))
        count += 1
    return count


@invariant("RP2", "accept length and output in range", "batch_result_processor.py")
def check_rp2(config: ModelConfig, obs: Observation) -> int:
    """RP2: 1 <= accept_len <= stride, the kept run is no longer than accept_len, and
    output_ids is what the environment emitted, within max_new_tokens (at a cap of 0 the
    prefill's token stays only when an abort ends the request) (batch_result_processor.py
    _resolve_spec_v2_tokens, schedule_batch.py update_finish_state)."""
    count = check_rp_output(config, obs)
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


@invariant("RP3", "metrics count live requests only", "#18848 / #23456 review", _spec)
def check_rp3(config: ModelConfig, obs: Observation) -> int:
    """RP3: global accept counters count only requests live at processing time, in a
    result that feeds them (a prefill result feeds none and reports (0, 0)) (PR 18848,
    23456 review; upstream still counts all: mutant B4)."""
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


@invariant("RP4", "no launch past a length finish in flight",
           "scheduler.py _reqs_finishing_inflight", _no_overshoot)
def check_rp4(config: ModelConfig, obs: Observation) -> int:
    """RP4: a launch carries no request that its results in flight already finish by
    length: processed output tokens + results in flight < max_new_tokens, or 1 where a
    refused prompt's cap is 0 (every result but a middle chunk's commits at least one). The release
    leaves such a request out of the decode; the overshoot era decoded it once more
    (#24590), so the claim is n/a in its cells
    (scheduler.py ``_reqs_finishing_inflight``, ``enable_skip_finishing_decode``)."""
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


@invariant("RP5", "finish reason and output are the environment's",
           "schedule_batch.py update_finish_state")
def check_rp5(config: ModelConfig, obs: Observation) -> int:
    """RP5: a finished request ended for the environment's reason, with its output: abort
    if one was requested before the result that ended it, else stop if the stop token
    falls inside the kept run (one past the cap is a length finish), else length; and its
    visible output is what the environment emitted (schedule_batch.py
    ``Req.update_finish_state``, ``_cap_finished_len_at_max_new_tokens``)."""
    finished = [r for r in obs.requests if r.finished or r.finish_reason is not None]
    for r in finished:
        truth = (r.ghost.finish_reason, r.ghost.output_len_true) if r.finished else (None, "-")
        if (r.finish_reason, r.output_len if r.finished else "-") != truth:
            raise fail("RP5", obs, f"for request r{r.rid}: finished ({r.finish_reason}) with "
                       f"{r.output_len} visible output tokens, the environment ended it "
                       f"({truth[0]}) with {truth[1]}")
    return len(finished)


@invariant("RP6", "per-request spec metrics count live verifies only",
           "batch_result_processor.py", _spec)
def check_rp6(config: ModelConfig, obs: Observation) -> int:
    """RP6: a request's spec_verify_ct and spec_num_correct_drafts count only the verify
    results processed while it was live (their number, and their accept_len - 1): a stale
    row adds nothing (batch_result_processor.py ``_resolve_spec_v2_tokens``)."""
    for r in obs.requests:
        if (r.spec_verify_ct, r.spec_num_correct_drafts) != (r.ghost.verify_ct,
                                                               r.ghost.correct_drafts):
            raise fail("RP6", obs, f"for request r{r.rid}: spec_verify_ct={r.spec_verify_ct}"
                       f", spec_num_correct_drafts={r.spec_num_correct_drafts}; its live "
                       f"verifies were {r.ghost.verify_ct} with {r.ghost.correct_drafts} "
                       "accepted drafts")
    return sum(1 for r in obs.requests if r.ghost.verify_ct)


@invariant("RP7", "output tokens are the environment's, in order",
           "schedule_batch.py output_ids / overlap_utils.py relay")
def check_rp7(config: ModelConfig, obs: Observation) -> int:
    """RP7: output_ids are the environment's tokens, in order: token i is the stand-in
    model's token at position prompt_len + i after token i - 1 (after the prompt's last
    for i = 0), or EOS as the last token; checked for the last token at every point, the
    tokens a result appended and every token at the end of an iteration. The model reads
    its input token from the relay under overlap, so a relayed sampled / bonus token that
    is not the one produced shows in the run after it (schedule_batch.py ``output_ids``,
    overlap_utils.py ``resolve_forward_inputs``)."""
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
        for i in range(start, len(out)):
            token = out[i]
            expected = compute_env_token(r.rid, r.prompt_len + i, previous)
            if token != expected and not (token == EOS_TOKEN and i == len(out) - 1):
                raise fail("RP7", obs, f"for request r{r.rid}: output token {i} is {token}; "
                           f"the environment emitted {expected} at position "
                           f"{r.prompt_len + i} after {previous}"
                           + (" (EOS only ends the output)" if token == EOS_TOKEN else ""))
            previous = token
        count += len(out) - start
    return count


@invariant("RP8", "a prefill-only batch generates nothing",
           "schedule_batch.py is_prefill_only #10889", _non_spec)
def check_rp8(config: ModelConfig, obs: Observation) -> int:
    """RP8: a batch flagged prefill-only (the release never decodes it) holds only requests
    capped to 0 new tokens; a request with tokens to generate in it would wait for a merge
    that may never come. The flag is the AND of its members' at prepare and merge, and a
    mixed step clears it (``mix_with_running``, #10889). Witnessed by each batch holding a
    request capped to 0, where the flag can be set (schedule_batch.py ``is_prefill_only``,
    scheduler.py ``get_next_batch_to_run``)."""
    count = 0
    for batch in _schedule_batches(obs):
        capped = [obs.get_request(rid).max_new_tokens == 0 for rid in batch.rids]
        if batch.is_prefill_only and not all(capped):
            rid = batch.rids[capped.index(False)]
            raise fail("RP8", obs, f"for request r{rid}: max_new_tokens="
                       f"{obs.get_request(rid).max_new_tokens} in a {batch.forward_mode} "
                       "batch flagged prefill-only, which is never decoded")
        count += any(capped)
    return count


@invariant("RP9", "no refused prompt runs", "scheduler.py validate_input_length")
def check_rp9(config: ModelConfig, obs: Observation) -> int:
    """RP9: no request holds KV for a prompt the release refuses (max_req_len - 5 tokens or
    more): ``validate_input_length`` refuses it and ``set_finish_with_abort`` queues it as
    one token with an abort, so only that one-token stand-in may run (a trace that shows no
    prompt token is given the benefit of the doubt there). Witnessed by each request
    holding KV (scheduler.py ``validate_input_length``, #3910, #9599)."""
    count = 0
    for r in _holding(obs):
        refused = compute_admission(r.prompt_len, 1, config.preset.max_context_len,
                                    config.kv_tokens, config.page_size)[1]
        stand_in = r.prompt_len == 1 and r.last_prompt_token in (None, REFUSED_PROMPT_TOKEN)
        if refused and not stand_in:
            raise fail("RP9", obs, f"for request r{r.rid}: a prompt of {r.prompt_len} "
                       f"tokens holds KV, where validate_input_length refuses it")
        count += 1
    return count


# The claims in definition order (a tuple: iterate it); INVARIANTS_BY_ID, the same by ID.
INVARIANTS: Final[tuple[Invariant, ...]] = tuple(_REGISTERED)
INVARIANTS_BY_ID: Final[Mapping[str, Invariant]] = {inv.id: inv for inv in INVARIANTS}
INVARIANT_IDS: Final = tuple(INVARIANTS_BY_ID)


def get_invariant(invariant_id: str) -> Invariant:
    """The invariant of ``invariant_id`` (``INVARIANTS_BY_ID``); a :class:`KeyError` naming
    the known IDs when there is none."""
    if invariant_id not in INVARIANTS_BY_ID:
        raise KeyError(f"unknown invariant {invariant_id!r}; known: {', '.join(INVARIANT_IDS)}")
    return INVARIANTS_BY_ID[invariant_id]
