"""Breadth-first enumeration of every operation sequence over a cell's alphabet.

Level d holds the distinct states that d operations reach. Every operation of the
alphabet (:mod:`overlap_spec.harness.exhaust.alphabet`) is run from every state of level
d, on a fresh copy of the state, with the :class:`InvariantChecker` watching every
observation point inside it; the states it reaches that no earlier level or earlier
sibling reached form level d + 1. Breadth first, the first violation found is a shortest
one (no sequence of fewer operations over the alphabet fails). An operation that fails
ends its sequence: the model stopped inside it, so there is no state to go on from.

**State copies.** The reference is plain Python: a state is a pickle of the scheduler
and the admitted request ids (the checker, which only counts and judges, is detached
while pickling and attached to each copy). Each operation runs on ``pickle.loads`` of
its parent's bytes.

**The dedup key** is a 128-bit BLAKE2b digest of those bytes, taken after
:func:`canonicalise`. Pickling writes every object reachable from the scheduler (its
requests and their ghosts, queues, batches, the result queue with its batch copies, the
pools and allocator, the FutureMap, the happens-before record, the refinement's
cursors, the fault set) with its exact values, the order of every list and dict and
which objects are shared, so two states with equal bytes restore to equal object graphs
and run identically from then on; and the search only ever continues from the restored
bytes, never from the live object. The converse does not hold: two equal states whose
equal strings or tuples are one object in one and two in the other pickle differently and
are explored twice (a cost, not a loss). A digest collision would merge two different
states; at 2^-128 per pair it is not a practical risk. :func:`canonicalise` first removes
what no later operation's observations or decisions depend on, so that states differing
only there merge:

- the happens-before record's race and checked-pair lists up to the refinement's
  cursors (``Refinement.observe`` only reads past them), and ``host_syncs`` (read only
  from the length it had when the current iteration began);
- ``Scheduler.step_index`` (the driver sets it before every operation);
- ``Runtime.shape``, the iteration's rung (``run_iteration`` sets it before any read;
  admit and abort do not read it);
- of ``Runtime.kv_cache`` (what each forward wrote where), the slots no request holds: KV14
  reads the contents of held rows, a tail copy reads its own row, and a slot freed and
  handed out again is read only where its new holder's forward failed to overwrite it,
  which KV14 reports whether the slot shows the old write or none (the old write is
  another holding's, never the new one's: the writer names the epoch). Kept, they would
  split states by which finished request last wrote a freed page. Held slots are kept,
  in slot order.

``tests/test_exhaust.py`` checks the claim on a sample: operation prefixes that reach
the same key are extended by the same suffixes, run from scratch, and must produce the
same observations and the same final state.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from overlap_spec.harness.crash import Crash
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.script import (
    Abort,
    Admit,
    AdmitPrebuilt,
    Continue,
    Flush,
    Iterate,
    Op,
    PauseRetract,
    Script,
    apply_op,
    run_script,
)
from overlap_spec.harness.exhaust.alphabet import (
    Alphabet,
    ChoiceOracle,
    get_alphabet,
    get_next_decisions,
)
from overlap_spec.reference.scheduler import Scheduler
from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.invariants import InvariantViolation
from overlap_spec.spec.units import RequestId

StateKey = bytes


class ReplayMismatch(AssertionError):
    """A counterexample found by the enumeration did not replay the same from scratch:
    a defect of this tier (the oracle's or the state copy's exactness), never a pass."""


@dataclass(frozen=True)
class Finding:
    """A shortest failing sequence: a violation, or a crash of the model."""

    ops: tuple[Op, ...]
    violation: InvariantViolation | None = None
    crash: Crash | None = None  # any other exception

    @property
    def ids(self) -> tuple[str, ...]:
        return self.violation.all_ids if self.violation is not None else ()

    def describe(self) -> str:
        if self.violation is not None:
            return str(self.violation)
        assert self.crash is not None
        return (f"the model crashed at op {len(self.ops) - 1}: "
                f"{self.crash.exception}: {self.crash.message}")


@dataclass
class Level:
    """One depth of the search: operations run from the previous level's states, and the
    states they reached that nothing shallower or earlier had."""

    depth: int
    transitions: int = 0
    new_states: int = 0
    merged: int = 0  # transitions that reached a state already seen


@dataclass
class Exploration:
    config: ModelConfig
    faults: frozenset[str]
    depth: int
    alphabet: Alphabet
    levels: list[Level] = field(default_factory=list)
    observations: int = 0
    exercised: Counter[str] = field(default_factory=Counter)
    # Violations that did not stop the search (with faults: IDs the stop rule does not
    # want), the first of each distinct set of IDs, then the one that stopped it.
    findings: list[Finding] = field(default_factory=list)
    stopped: Finding | None = None
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    # With explore(keep_paths=True): the first path to each state key, and pairs of
    # different paths that reached the same key (for the dedup key's test).
    paths: dict[StateKey, tuple[Op, ...]] = field(default_factory=dict)
    merges: list[tuple[tuple[Op, ...], tuple[Op, ...]]] = field(default_factory=list)

    @property
    def states(self) -> int:
        """Distinct states reached, the initial one included."""
        return 1 + sum(level.new_states for level in self.levels)

    @property
    def transitions(self) -> int:
        return sum(level.transitions for level in self.levels)

    @property
    def complete(self) -> bool:
        """Every sequence up to the depth bound ran (nothing stopped the search)."""
        return self.stopped is None


def canonicalise(model: Scheduler) -> None:
    """Drop what no later operation's observations or decisions depend on (see the module
    docstring); the state's future behaviour, as this tier sees it, is unchanged."""
    hb, refinement = model.rt.hb, model.refinement
    hb.races = hb.races[refinement.races_seen:]
    refinement.races_seen = 0
    hb.checked = hb.checked[refinement.checked_seen:]
    refinement.checked_seen = 0
    hb.host_syncs = []
    model.step_index = 0
    model.rt.shape = model.config.get_shape()
    rt = model.rt
    held = {slot for req in model.requests.values()
            if req.holds_kv and req.req_pool_idx is not None
            for slot in rt.req_to_token.rows[req.req_pool_idx][:max(req.kv_allocated_len, 0)]}
    rt.kv_cache = {slot: rt.kv_cache[slot] for slot in sorted(held) if slot in rt.kv_cache}


def get_state_bytes(model: Scheduler, admitted: list[RequestId]) -> bytes:
    """The canonical pickle of a state, without its observer."""
    canonicalise(model)
    observer = model.refinement.observer
    model.refinement.observer = None
    try:
        return pickle.dumps((model, admitted), protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        model.refinement.observer = observer


def get_state_key(state: bytes) -> StateKey:
    return hashlib.blake2b(state, digest_size=16).digest()


def restore_state(state: bytes, checker: InvariantChecker) -> tuple[Scheduler, list[RequestId]]:
    model, admitted = pickle.loads(state)
    model.refinement.observer = checker
    return model, admitted


Stop = Callable[[InvariantViolation], bool]


def _any_violation(violation: InvariantViolation) -> bool:
    return True


@dataclass(frozen=True)
class Outcome:
    op: Op
    state: bytes | None  # the state reached; None when the operation failed
    violation: InvariantViolation | None = None
    crash: Crash | None = None


def _run(state: bytes, depth: int, checker: InvariantChecker, op: Op | None,
         oracle: ChoiceOracle | None, peek: bool) -> Outcome:
    """One operation (or, with ``oracle``, one iteration leaf) on a copy of ``state``."""
    model, admitted = restore_state(state, checker)
    model.set_step_index(depth)
    violation: InvariantViolation | None = None
    crash: Crash | None = None
    try:
        if oracle is not None:
            oracle.attach(model, peek)
            model.run_iteration(oracle.as_choices())
        elif op is not None:
            apply_op(model, op, admitted)
    except InvariantViolation as error:
        violation = error
    except Exception as error:  # noqa: BLE001 - a crash is a finding, never a pass
        crash = Crash.of(error)
    done: Op | None = Iterate(oracle.get_choices()) if oracle is not None else op
    assert done is not None
    if violation is not None or crash is not None:
        return Outcome(done, None, violation, crash)
    return Outcome(done, get_state_bytes(model, admitted))


def run_operations(state: bytes, admitted_count: int, depth: int, alphabet: Alphabet,
                   checker: InvariantChecker, peek: bool = True) -> Iterator[Outcome]:
    """Every operation of the alphabet from ``state``, each on its own copy: every
    distinguishable iteration, then the admissions (below the request bound), then an
    abort of each admitted request, then a flush, a pause and a continue where the alphabet
    has them. The order
    leaves each level's states unchanged; it only decides which shortest counterexample
    is met first, and iterations first meet one sooner (docs/exhaust.md)."""
    decisions: list[int] | None = []
    while decisions is not None:
        oracle = ChoiceOracle(alphabet, decisions)
        yield _run(state, depth, checker, None, oracle, peek)
        decisions = get_next_decisions(oracle.taken)
    if admitted_count < alphabet.max_requests:
        for admission in alphabet.admissions:
            yield _run(state, depth, checker, admission, None, peek)
    for index in range(admitted_count):
        yield _run(state, depth, checker, Abort(index), None, peek)
    if alphabet.flush:
        yield _run(state, depth, checker, Flush(), None, peek)
    if alphabet.pause:  # each a no-op where it does not apply (paused, or not), merged away
        yield _run(state, depth, checker, PauseRetract(), None, peek)
        yield _run(state, depth, checker, Continue(), None, peek)


def explore(config: ModelConfig, depth: int, faults: frozenset[str] = frozenset(),
            stop: Stop = _any_violation, alphabet: Alphabet | None = None,
            peek: bool = True, keep_paths: bool = False) -> Exploration:
    """Every sequence of at most ``depth`` operations over the alphabet, breadth first.

    Stops at the first crash, or at the first violation ``stop`` accepts (a shortest
    one); other violations are recorded (the first of each set of IDs) and the search
    goes on around them.
    """
    alphabet = alphabet or get_alphabet(config)
    result = Exploration(config, faults, depth, alphabet)
    wall, cpu = time.perf_counter(), time.process_time()
    checker = InvariantChecker(config, track_mechanisms=False)
    root = Scheduler(config, faults, checker)
    root_state = get_state_bytes(root, [])
    seen: set[StateKey] = {get_state_key(root_state)}
    if keep_paths:
        result.paths[get_state_key(root_state)] = ()
    frontier: list[tuple[bytes, int, tuple[Op, ...]]] = [(root_state, 0, ())]
    recorded: set[tuple[str, ...]] = set()
    try:
        for level_depth in range(1, depth + 1):
            level = Level(level_depth)
            result.levels.append(level)
            following: list[tuple[bytes, int, tuple[Op, ...]]] = []
            for state, admitted_count, path in frontier:
                for outcome in run_operations(state, admitted_count, level_depth - 1,
                                              alphabet, checker, peek):
                    level.transitions += 1
                    ops = (*path, outcome.op)
                    if outcome.crash is not None:
                        result.stopped = Finding(ops, crash=outcome.crash)
                        return result
                    if outcome.violation is not None:
                        finding = Finding(ops, outcome.violation)
                        if stop(outcome.violation):
                            result.stopped = finding
                            return result
                        if finding.ids not in recorded:
                            recorded.add(finding.ids)
                            result.findings.append(finding)
                        continue
                    assert outcome.state is not None
                    key = get_state_key(outcome.state)
                    if key in seen:
                        level.merged += 1
                        if keep_paths:
                            result.merges.append((result.paths[key], ops))
                        continue
                    seen.add(key)
                    if keep_paths:
                        result.paths[key] = ops
                    level.new_states += 1
                    if level_depth < depth:
                        admitted = admitted_count + isinstance(outcome.op, Admit | AdmitPrebuilt)
                        following.append((outcome.state, admitted, ops))
            frontier = following
    finally:
        result.observations = checker.observations
        result.exercised = Counter(checker.exercised)
        result.wall_seconds = time.perf_counter() - wall
        result.cpu_seconds = time.process_time() - cpu
    return result


def get_script(result: Exploration, finding: Finding) -> Script:
    return Script.for_config(result.config, list(finding.ops), tuple(sorted(result.faults)))


def check_replays(result: Exploration, finding: Finding) -> None:
    """The finding's script, run from scratch by ``run_script`` (what ``overlap-spec
    replay`` does), must fail the same way; else :class:`ReplayMismatch`."""
    outcome = run_script(get_script(result, finding), catch_crash=True)
    expected = finding.describe()
    if finding.crash is not None:
        got = (f"the model crashed at op {outcome.failed_at}: {outcome.crash}"
               if outcome.crash is not None else "no crash")
    else:
        got = str(outcome.violation) if outcome.violation is not None else "no violation"
    if (got != expected or outcome.failed_at != len(finding.ops) - 1
            or outcome.crashed != finding.crash):  # a crash: the same function raised it too
        raise ReplayMismatch(f"{result.config.name}: the enumeration found {expected!r} "
                             f"after {len(finding.ops)} ops, the replay gives {got!r} "
                             f"(op {outcome.failed_at})")
