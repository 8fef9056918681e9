"""What a run reached: the model's mechanisms, each recognised in the observations.

An invariant's witness count says the predicate was evaluated where it could fail; it
does not say which code paths produced the states it was evaluated on. A run at the
preset's own sizes never chunks a prompt, for instance, and its invariants still pass
with witnesses. So the checker also counts, per mechanism, the operations of the script
during which an observation showed that mechanism at work (:class:`MechanismTracker`).
``check`` and ``review`` print and save these counts; ``tests/test_mechanisms.py`` fails
when ``check``'s default run leaves one at zero.

Every mechanism is recognised from the spec's observations only (what any implementation
shows through its refinement), never from the script that was asked for, so a count
says what happened: an admission asked for and refused by the pool counts nothing.
A new mechanism of the model joins :data:`MECHANISMS`, and the test then requires it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.state import (
    REFUSED_PROMPT_TOKEN,
    Observation,
    ObservationPoint,
    RequestView,
)
from overlap_spec.spec.units import RequestId


@dataclass(frozen=True)
class Mechanism:
    id: str
    what: str  # what the observation shows
    reached_by: str  # where check's default run reaches it


# rid -> the request's view at the previous observation
_Previous = dict[RequestId, RequestView]


@dataclass
class MechanismTracker:
    """Counts, per mechanism, the script operations during which it was observed. Holds
    the previous view of each request, since some mechanisms are changes (a request that
    became retracted) rather than states."""

    config: ModelConfig
    ops: dict[str, set[int]] = field(default_factory=dict)
    _previous: _Previous = field(default_factory=dict)
    # (rid, epoch) that an extend or mixed batch carried: a request that gets its first
    # output without one arrived prebuilt (PD decode).
    _prefilled: set[tuple[RequestId, int]] = field(default_factory=set)
    _chunked_rid: RequestId | None = None  # Scheduler.chunked_req at the previous observation
    _tree_size: int = 0  # a radix cell's tree, in positions, at the previous observation

    def __call__(self, obs: Observation) -> None:
        for mechanism, seen in _RECOGNISERS:
            if seen(self, obs):
                self.ops.setdefault(mechanism, set()).add(obs.step_index)
        if obs.batch is not None and obs.batch.forward_mode in ("extend", "mixed"):
            epochs = {r.rid: r.ghost.epoch for r in obs.requests}
            self._prefilled.update((rid, epochs.get(rid, 0)) for rid in obs.batch.rids)
        self._previous = {r.rid: r for r in obs.requests}
        self._chunked_rid = obs.chunked_rid
        self._tree_size = _get_tree_size(obs)

    def get_counts(self) -> dict[str, int]:
        return {mechanism: len(steps) for mechanism, steps in self.ops.items()}

    def _changed(self, obs: Observation, became: Callable[[RequestView], bool]) -> bool:
        """Whether some request shows ``became`` now and did not at the previous
        observation."""
        return any(became(r) and not (r.rid in self._previous and became(self._previous[r.rid]))
                   for r in obs.requests)


def _retracted(r: RequestView) -> bool:
    return r.is_retracted and r.waiting


def _oom_aborted(r: RequestView) -> bool:
    return r.finished and r.finish_reason == "abort" and not r.waiting


def _refused(r: RequestView) -> bool:
    """Queued anyway, as a one-token prompt of the refused token, to finish "abort" at its
    prefill's result (``set_finish_with_abort``)."""
    return r.last_prompt_token == REFUSED_PROMPT_TOKEN


def _mixed(obs: Observation) -> bool:
    return obs.batch is not None and obs.batch.forward_mode == "mixed"


def _is_prebuilt(tracker: MechanismTracker, obs: Observation) -> bool:
    for r in obs.requests:
        previous = tracker._previous.get(r.rid)
        if (r.output_len >= 1 and (previous is None or previous.output_len == 0)
                and not r.finished and (r.rid, r.ghost.epoch) not in tracker._prefilled):
            return True
    return False


def _chunked_abort(tracker: MechanismTracker, obs: Observation) -> bool:
    """The chunked request (at the previous observation) finished "abort" now: an abort
    asked of it finishes it only at a later step's top (the record shows no pending
    abort before that)."""
    rid = tracker._chunked_rid
    return rid is not None and tracker._changed(
        obs, lambda r: r.rid == rid and r.finished and r.finish_reason == "abort")


def _get_tree_size(obs: Observation) -> int:
    tree = obs.tree
    return 0 if tree is None else tree.evictable_size + tree.protected_size


def _rung_down(tracker: MechanismTracker, obs: Observation) -> bool:
    forward = obs.forward
    return (forward is not None and forward.purpose in ("draft", "verify")
            and forward.draft_tokens < tracker.config.draft_tokens)


MECHANISMS: Final = (
    Mechanism("chunked-prefill", "a prefill chunk that stops short of its prompt "
              "(Scheduler.chunked_req set at prepare_for_extend)",
              "the chunked and mixed size variants"),
    Mechanism("chunk-continued", "the next chunk of a chunked request admitted first "
              "(PrefillAdder.add_chunked_req)", "the chunked and mixed size variants"),
    Mechanism("chunked-abort", "an abort of the chunked request, deferred to the next step's "
              "top (process_pending_chunked_abort)", "the chunked and mixed size variants"),
    Mechanism("mixed-chunk", "running decodes riding in a prefill chunk's batch "
              "(mix_with_running, non-spec)", "the mixed size variant"),
    Mechanism("spec-mixed-tail", "spec decodes riding in a prefill chunk's batch as tails",
              "the mixed size variant, spec cells with the host mirror"),
    Mechanism("retraction", "a running request retracted to the waiting queue "
              "(retract_decode)", "every size set, more often in the small pools"),
    Mechanism("oom-abort", "the last request aborted because even it alone does not fit "
              "(retract_decode's out-of-memory abort)", "the out-of-memory size variant, spec "
              "cells"),
    Mechanism("pd-prebuilt", "a request whose first output arrived without a prefill here "
              "(PD decode, process_prebuilt)", "the preset's own sizes (not with chunking)"),
    Mechanism("refused-prompt", "a prompt too long for the context, queued to finish "
              "abort (set_finish_with_abort)", "every size set"),
    Mechanism("admission-stopped", "an admission that left waiting requests behind (no row, "
              "no budget or the batch_is_full latch)", "every size set"),
    Mechanism("stale-result", "a result processed for a request finished or retracted "
              "since its launch", "every size set with overlap"),
    Mechanism("rung-down", "a spec decode at a shallower rung than configured (the adaptive "
              "controller)", "the chain cells"),
    Mechanism("prefix-hit", "an admission candidate matched a prefix in the radix tree "
              "(match_prefix at init_next_round_input)", "the radix cells"),
    Mechanism("shared-prefix", "a tree node locked by two live requests at once (a shared "
              "prefix in use)", "the radix cells"),
    Mechanism("tree-eviction", "the radix tree shrank: unlocked leaves evicted for an "
              "allocation or a retraction", "the radix cells"),
    Mechanism("cache-flush", "a flush_cache ran on a non-empty radix tree (at full idle)",
              "the radix cells"),
    Mechanism("pause-retract", "pause_generation(mode=\"retract\") retracted a request "
              "(every unfinished one running, just prefilled or chunked)", "every size set"),
)

_RECOGNISERS: Final[tuple[tuple[str, Callable[[MechanismTracker, Observation], bool]], ...]] = (
    ("chunked-prefill", lambda t, obs: obs.point is ObservationPoint.PREPARE_FOR_EXTEND
     and obs.chunked_rid is not None),
    ("chunk-continued", lambda t, obs: obs.admission is not None
     and obs.admission.continued is not None),
    ("chunked-abort", _chunked_abort),
    ("mixed-chunk", lambda t, obs: _mixed(obs) and not t.config.cell.is_spec),
    ("spec-mixed-tail", lambda t, obs: _mixed(obs) and t.config.cell.is_spec),
    ("retraction", lambda t, obs: obs.point is ObservationPoint.RETRACT_DECODE
     and t._changed(obs, _retracted)),
    ("oom-abort", lambda t, obs: obs.point is ObservationPoint.RETRACT_DECODE
     and t._changed(obs, _oom_aborted)),
    ("pd-prebuilt", _is_prebuilt),
    ("refused-prompt", lambda t, obs: t._changed(obs, _refused)),
    ("admission-stopped", lambda t, obs: obs.admission is not None
     and obs.admission.admitted < len(obs.admission.waiting)),
    ("stale-result", lambda t, obs: obs.result is not None
     and any(e.stale for e in obs.result.entries)),
    ("rung-down", _rung_down),
    ("prefix-hit", lambda t, obs: obs.admission is not None
     and any(p > 0 for p in obs.admission.prefixes)),
    ("shared-prefix", lambda t, obs: obs.tree is not None
     and any(n.lock_ref >= 2 for n in obs.tree.nodes)),
    ("tree-eviction", lambda t, obs: obs.tree is not None
     and obs.point is not ObservationPoint.FLUSH_CACHE and _get_tree_size(obs) < t._tree_size),
    ("cache-flush", lambda t, obs: obs.point is ObservationPoint.FLUSH_CACHE
     and t._tree_size > 0),
    ("pause-retract", lambda t, obs: obs.point is ObservationPoint.PAUSE_GENERATION
     and t._changed(obs, _retracted)),
)

assert [m.id for m in MECHANISMS] == [name for name, _ in _RECOGNISERS]


def render_mechanisms(counts: dict[str, int]) -> str:
    """One line: each mechanism and the operations that reached it, zeros marked."""
    parts = [f"{m.id} {counts.get(m.id, 0)}" + ("" if counts.get(m.id, 0) else " (UNREACHED)")
             for m in MECHANISMS]
    return "mechanisms reached (operations): " + ", ".join(parts)
