"""FM: the FutureMap relay under overlap. The forward publishes ``new_seq_lens`` and stashes
sampled tokens; the schedule side and the next forward read them back once, after the
publish or stash that wrote them, from the rows of their current owner."""

from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.invariants.registry import fail, invariant
from overlap_spec.spec.invariants.st import check_races
from overlap_spec.spec.state import Observation


@invariant("FM1", is_spec=True, overlap=True)
def check_fm1(config: ModelConfig, obs: Observation) -> int:
    """publish before read

    every schedule-side or D-side read of new_seq_lens_buf[p] happens after the forward's latest
    publish of p.

    Source: overlap_utils.py publish_ready.
    """
    return check_races("FM1", obs)


@invariant("FM2", is_spec=True, overlap=True)
def check_fm2(config: ModelConfig, obs: Observation) -> int:
    """publish_ready single capture covers publishes

    the latest capture of publish_ready covers every publish whose row is read: a single capture
    point.

    Source: PR 30435 / 35748.
    """
    resolve = obs.resolve
    if resolve is None:
        return 0
    if resolve.uncovered_rows:
        raise fail("FM2", obs, f"for new_seq_lens_buf rows {list(resolve.uncovered_rows)}: "
                   "publish_ready was captured before their latest publish")
    return len(resolve.rows)


@invariant("FM3", overlap=True)
def check_fm3(config: ModelConfig, obs: Observation) -> int:
    """stash before gather

    forward-only relay rows read at forward entry were stashed by an earlier forward on the same
    stream or by a seed ordered before it.

    Source: overlap_utils.py stash.
    """
    check_races("FM3", obs)
    return len(obs.launch.relay_gathers) if obs.launch is not None else 0


@invariant("FM4", overlap=True)
def check_fm4(config: ModelConfig, obs: Observation) -> int:
    """consume-once relay rows

    between two gathers of output_tokens_buf[p] there is exactly one stash of p holding a token
    to consume (consume-once); a middle chunk's, which its next chunk's overwrites, is none.

    Source: PR 30471.
    """
    if obs.launch is None:
        return 0
    for g in obs.launch.relay_gathers:
        if g.stashes_since_last_gather != 1:
            raise fail("FM4", obs, f"for request r{g.rid}: output_tokens_buf[{g.row}] "
                       f"gathered after {g.stashes_since_last_gather} stashes, expected 1")
    return len(obs.launch.relay_gathers)


@invariant("FM5", overlap=True)
def check_fm5(config: ModelConfig, obs: Observation) -> int:
    """relay row belongs to its owner

    a relay row is read only after its current owner seeded it: a prefill publish or stash;
    every row read is a request row, 1..max_running_requests (0 is the padding row; a list would
    wrap a negative one).

    Source: overlap_utils.py, req_pool_idx indexing.
    """
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


@invariant("FM6", is_spec=True, overlap=True)
def check_fm6(config: ModelConfig, obs: Observation) -> int:
    """publish_ready consumed once

    each resolve that waits on publish_ready consumes a publish recorded since the previous
    resolve (consume-once).

    Source: overlap_utils.py _publish_fresh, PR 30471.
    """
    resolve = obs.resolve
    if resolve is None or resolve.fresh_publish is None:
        return 0
    if not resolve.fresh_publish:
        raise fail("FM6", obs, "resolve_seq_lens_cpu waited on a publish_ready that no "
                   "publish re-armed since the previous resolve consumed it")
    return 1


@invariant("FM7", is_spec=True, overlap=True)
def check_fm7(config: ModelConfig, obs: Observation) -> int:
    """resolved rows re-published first

    a resolve gathers a new_seq_lens_buf row only if it was published since the previous resolve
    gathered it (upstream's CI poisons gathered rows with -1 and asserts non-negative values).

    Source: overlap_utils.py _assert_nonneg_and_invalidate, PR 30471.
    """
    resolve = obs.resolve
    if resolve is None:
        return 0
    if resolve.regathered_rows:
        raise fail("FM7", obs, f"for new_seq_lens_buf rows {list(resolve.regathered_rows)}: "
                   "gathered again with no publish since the previous resolve consumed them "
                   "(upstream's CI would read the -1 poison)")
    return len(resolve.rows)
