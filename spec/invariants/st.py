"""ST: stream ordering under overlap. The forward waits for the schedule stream's inputs,
the schedule stream writes ``req_to_token`` only after the forward read it, tensors live
until their forward completes, the host blocks only where it must, and results are
processed in order, once.

A race found by the happens-before record is broken by one claim, of this family or FM's:
:func:`classify_race` says which, for both (``fm`` imports :func:`check_races`)."""

from overlap_spec.spec import transitions as tr
from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.happens_before import FORWARD, SCHEDULE, Race
from overlap_spec.spec.invariants.registry import fail, invariant
from overlap_spec.spec.state import Observation


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


def check_races(invariant_id: str, obs: Observation) -> int:
    """Fail on a race this claim owns; else the witnesses: the cross-participant access
    pairs of this claim whose order was checked since the previous observation."""
    mine = [race for race in obs.races if classify_race(race) == invariant_id]
    if mine:
        raise fail(invariant_id, obs, f"for buffer {mine[0].later.key[0]}"
                   f"[{mine[0].later.key[1]}]: {mine[0].describe()}")
    return sum(classify_race(pair) == invariant_id for pair in obs.checked_pairs)


@invariant("ST1", overlap=True)
def check_st1(config: ModelConfig, obs: Observation) -> int:
    """RAW: F waits for S at launch

    the forward reads schedule-produced tensors only after F.wait_stream(S).

    Source: scheduler.py run_batch.
    """
    return check_races("ST1", obs)


@invariant("ST2", overlap=True)
def check_st2(config: ModelConfig, obs: Observation) -> int:
    """WAR: S writes after F reads

    schedule-side writes to req_to_token after launching B_i are ordered after F_i's reads.

    Source: scheduler.py _apply_war_barrier, PR 26380 / 31687.
    """
    return check_races("ST2", obs)


@invariant("ST3")
def check_st3(config: ModelConfig, obs: Observation) -> int:
    """host blocks only on D2H and copy_done

    one iteration blocks the host at most on the private D2H and copy_done, never on the
    schedule stream under overlap.

    Source: PR 26380 / 26463.
    """
    if obs.host_syncs is None:
        return 0
    if config.cell.overlap and f"stream:{SCHEDULE}" in obs.host_syncs:
        raise fail("ST3", obs, "for the iteration: a host sync on the schedule stream, which "
                   f"the WAR fence chains to the whole forward (syncs: {list(obs.host_syncs)})")
    budget = tr.compute_host_sync_budget(config.cell)
    if len(obs.host_syncs) > budget:
        raise fail("ST3", obs, f"for the iteration: {len(obs.host_syncs)} host syncs > "
                   f"budget {budget} ({list(obs.host_syncs)})")
    return 1 if obs.launched_this_iteration else 0


@invariant("ST4", overlap=True)
def check_st4(config: ModelConfig, obs: Observation) -> int:
    """tensors live until F completes

    a schedule-produced tensor read by F_i stays referenced until F_i completed.

    Source: scheduler.py batch_record_buf two-slot ring.
    """
    return check_races("ST4", obs)


@invariant("ST5")
def check_st5(config: ModelConfig, obs: Observation) -> int:
    """results FIFO, once, after copy_done

    results are processed in launch order, once, after copy_done, with at most one pending under
    overlap.

    Source: scheduler.py result_queue.
    """
    check_races("ST5", obs)
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
