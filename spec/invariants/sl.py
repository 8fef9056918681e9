"""SL: the sequence-length mirror. A batch's lengths live on the device (``seq_lens``), on
the host (``seq_lens_cpu`` and the lazy ``seq_lens_sum``) and, under speculative decoding
v2, in the FutureMap relay; these claims say where the copies must agree, and what the
draft-extend's +D_tok and ``run_batch``'s isolation may change."""

from overlap_spec.spec import transitions as tr
from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.invariants.registry import fail, invariant
from overlap_spec.spec.state import BatchView, Observation, ObservationPoint


@invariant("SL1")
def check_sl1(config: ModelConfig, obs: Observation) -> int:
    """init_new sum matches seq_lens_cpu

    at init_new, FB.seq_lens_cpu is None or FB.seq_lens_sum == sum(FB.seq_lens_cpu) with
    matching lengths.

    Source: forward_batch_info.py init_new, PR 25818.
    """
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


@invariant("SL2")
def check_sl2(config: ModelConfig, obs: Observation) -> int:
    """GPU seq_lens mirrors seq_lens_cpu

    wherever SB.seq_lens_cpu is present, SB.seq_lens equals it elementwise.

    Source: schedule_batch.py, PR 26020 mirror.
    """
    count = 0
    for batch in obs.get_schedule_batches():
        if batch.seq_lens_cpu is None:
            continue
        for j, (gpu, cpu) in enumerate(zip(batch.seq_lens, batch.seq_lens_cpu, strict=False)):
            if gpu != cpu:
                raise fail("SL2", obs, f"for request r{batch.rids[j]}: seq_lens={gpu} "
                           f"!= seq_lens_cpu={cpu}")
        count += 1
    return count


@invariant("SL3")
def check_sl3(config: ModelConfig, obs: Observation) -> int:
    """seq_lens_sum is None or the sum

    SB.seq_lens_sum is None or equals sum(SB.seq_lens_cpu).

    Source: schedule_batch.py, PR 25818 lazy sum.
    """
    summed = [batch for batch in obs.get_schedule_batches() if batch.seq_lens_sum is not None]
    for batch in summed:
        if batch.seq_lens_cpu is None:
            raise fail("SL3", obs, f"for the batch: seq_lens_sum={batch.seq_lens_sum} "
                       "while seq_lens_cpu is None")
        if batch.seq_lens_sum != sum(batch.seq_lens_cpu):
            raise fail("SL3", obs, f"for the batch: seq_lens_sum={batch.seq_lens_sum} "
                       f"!= sum(seq_lens_cpu)={sum(batch.seq_lens_cpu)}")
    return len(summed)


@invariant("SL4")
def check_sl4(config: ModelConfig, obs: Observation) -> int:
    """batch fields share one length

    in a batch holding requests, reqs, seq_lens, req_pool_indices(_cpu) and seq_lens_cpu have
    one length, and spec_info.future_indices equals req_pool_indices; an emptied batch keeps
    stale tensors, never read (0.5.23's callers of ``filter_batch`` check ``is_empty()``).

    Source: schedule_batch.py filter_batch, merge_batch.
    """
    reshaped = obs.point in (ObservationPoint.FILTER_BATCH, ObservationPoint.MERGE_BATCH,
                             ObservationPoint.RETRACT_DECODE)
    holding = [batch for batch in obs.get_schedule_batches() if batch.rids]
    for batch in holding:
        lengths = {"reqs": len(batch.rids), "seq_lens": len(batch.seq_lens),
                   "req_pool_indices": len(batch.req_pool_indices),
                   "req_pool_indices_cpu": len(batch.req_pool_indices_cpu)}
        if batch.seq_lens_cpu is not None:
            lengths["seq_lens_cpu"] = len(batch.seq_lens_cpu)
        if len(set(lengths.values())) > 1:
            raise fail("SL4", obs, f"for the batch: lengths differ {lengths}")
        if batch.future_indices is not None and batch.future_indices != batch.req_pool_indices:
            raise fail("SL4", obs, f"for the batch: future_indices={list(batch.future_indices)}"
                       f" != req_pool_indices={list(batch.req_pool_indices)}")
    return len(holding) if reshaped else 0


@invariant("SL5")
def check_sl5(config: ModelConfig, obs: Observation) -> int:
    """no sentinel seq_lens

    seq_lens is never a sentinel: >= 0, and >= 1 in decode.

    Source: PR 25962, 26020.
    """
    batches = obs.get_schedule_batches()
    for batch in batches:
        floor = 1 if batch.forward_mode == "decode" else 0
        for rid, value in zip(batch.rids, batch.seq_lens, strict=False):
            if value < floor:
                raise fail("SL5", obs, f"for request r{rid}: seq_lens={value} < {floor}")
    fb = obs.forward
    if fb is not None:
        floor = 0 if fb.purpose == "extend" else 1
        for j, value in enumerate(fb.seq_lens):
            if value < floor:
                raise fail("SL5", obs, f"for row {j} of the {fb.purpose} ForwardBatch: "
                           f"seq_lens={value} < {floor}")
    return len(batches) + (0 if fb is None else 1)


@invariant("SL6", is_spec=True)
def check_sl6(config: ModelConfig, obs: Observation) -> int:
    """spec seq_lens at launch is the truth

    at a spec decode launch, SB.seq_lens[j] equals the latest published new_seq_lens of the
    request and its true KV length.

    Source: overlap_utils.py resolve.
    """
    launch = obs.launch
    if (obs.point is not ObservationPoint.LAUNCH or launch is None
            or launch.forward_mode != "decode"):
        return 0
    for m in launch.members:
        if m.published_seq_len is not None and m.seq_len != m.published_seq_len:
            raise fail("SL6", obs, f"for request r{m.rid}: seq_lens={m.seq_len} != "
                       f"new_seq_lens_buf={m.published_seq_len}")
        if m.seq_len != m.ghost_kv_len:
            raise fail("SL6", obs, f"for request r{m.rid}: seq_lens={m.seq_len} != "
                       f"true KV length={m.ghost_kv_len}")
    return len(launch.members)


@invariant("SL7", is_spec=False)
def check_sl7(config: ModelConfig, obs: Observation) -> int:
    """non-spec decode seq_lens arithmetic

    after a non-spec prepare_for_decode, seq_lens == kv_committed_len == kv_allocated_len ==
    prompt + output + in-flight steps.

    Source: schedule_batch.py.
    """
    if obs.point is not ObservationPoint.PREPARE_FOR_DECODE or obs.batch is None:
        return 0
    for rid, seq_len in zip(obs.batch.rids, obs.batch.seq_lens, strict=False):
        r = obs.get_request(rid)
        expected = tr.compute_ns_expected_seq_len(r.prompt_len, r.output_len,
                                               r.ghost.inflight_steps)
        if not seq_len == r.kv_committed_len == r.kv_allocated_len == expected:
            raise fail("SL7", obs, f"for request r{rid}: seq_lens={seq_len}, kv_committed_len="
                       f"{r.kv_committed_len}, kv_allocated_len={r.kv_allocated_len}, "
                       f"expected {expected}")
    return len(obs.batch.rids)


@invariant("SL8", is_spec=True)
def check_sl8(config: ModelConfig, obs: Observation) -> int:
    """verify publishes s + accept_len

    verify at seq_lens=s publishes s + accept_len with 1 <= accept_len <= max; extend publishes
    s.

    Source: multi_layer_eagle_worker_v2.py on_publish.
    """
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
    return {"forward_mode": batch.forward_mode, "reqs": batch.rids, "seq_lens": batch.seq_lens,
            "seq_lens_cpu": batch.seq_lens_cpu, "seq_lens_sum": batch.seq_lens_sum,
            "req_pool_indices": batch.req_pool_indices}


@invariant("SL9", is_spec=True)
def check_sl9(config: ModelConfig, obs: Observation) -> int:
    """run_batch isolation restores SB

    a spec run_batch leaves every SB field as it found it except input_ids and spec_info;
    without overlap it re-applies new_seq_lens consistently.

    Source: scheduler.py.
    """
    iso = obs.isolation
    if obs.point is not ObservationPoint.RUN_BATCH or iso is None:
        return 0
    before, after = _mirror_fields(iso.entry), _mirror_fields(iso.exit)
    new = iso.reapplied_seq_lens
    if new is not None:
        before["seq_lens"] = new
        if iso.entry.seq_lens_cpu is not None:
            before.update(seq_lens_cpu=new, seq_lens_sum=sum(new))
    for name, value in before.items():
        if after[name] != value:
            raise fail("SL9", obs, f"for the batch field {name}: after run_batch {after[name]}"
                       f" != expected {value}")
    return 1


@invariant("SL10", is_spec=True)
def check_sl10(config: ModelConfig, obs: Observation) -> int:
    """draft-extend mutation stays on FB

    the draft-extend +D_tok lands on the ForwardBatch (seq_lens, cpu, sum) and never on the
    ScheduleBatch.

    Source: eagle_info_v2.py, PR 26020.
    """
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


@invariant("SL11", is_spec=True, overlap=True, needs_cpu_seq_lens=False)
def check_sl11(config: ModelConfig, obs: Observation) -> int:
    """no host length without the mirror (#27979: an upper bound)

    with no host mirror the release keeps no host length after a resolve (``seq_lens_cpu``,
    ``seq_lens_sum`` None: the no-D2H path); under the proposal that keeps one,
    seq_len_cpu_ub >= max(seq_lens).

    Source: PR 26128; the closed PR 27979, not in 0.5.23.
    """
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
