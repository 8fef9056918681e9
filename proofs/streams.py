"""Happens-before proofs: the stream protocol of the overlap loop as ordering constraints.

Every operation gets an integer time. A stream is a FIFO queue (its operations run
in enqueue order), an operation runs after the host enqueued it, ``record`` captures
the stream's last operation, ``wait_event`` / ``wait_stream`` delay everything the
waiter enqueues later, and ``synchronize`` blocks the host until the captured
operation ran. Any assignment of times meeting these constraints is an execution
the GPU may choose. A pair of conflicting accesses on different participants is
safe when every execution orders them as the host program does; Z3 proves it, or
returns an execution (a counterexample schedule) where they run the other way.

The pair's invariant ID is the spec's own classification
(``spec.invariants.classify_race``), so FM1 / FM3 / ST1 / ST2 / ST4 mean here what the
reference's vector-clock check means. FM2 (single capture point of
``publish_ready``) and ST3 (host sync budget) are claims about the program itself.

The program is three iterations of ``event_loop_overlap`` (digest section 3.1),
written from ``reference/scheduler.py``'s order; faults B5, B8, B9, B13, B15 change
it the way the reference's faults do. A spec forward records the read-done event
after the draft-extend's ``req_to_token`` read, past the publish, as 0.5.23 does; the
``early_fence`` proposal records it before the publish.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.solver import Term
from overlap_spec.spec.config import Cell
from overlap_spec.spec.happens_before import COPY, D2H, FORWARD, HOST, SCHEDULE, Access, Race
from overlap_spec.spec.invariants import classify_race
from overlap_spec.spec.transitions import compute_host_sync_budget

ITERATIONS: Final = 3
STREAM_MUTANTS: Final = ("B5", "B8", "B9", "B13", "B15")


@dataclass(frozen=True)
class Op:
    index: int
    participant: str
    kind: str  # read | write | free | record | wait_event | wait_stream | sync
    target: str  # buffer key "name[row]", event name, or the stream waited on / synced
    label: str


@dataclass
class Program:
    ops: list[Op] = field(default_factory=list)

    def add(self, participant: str, kind: str, target: str, label: str) -> None:
        self.ops.append(Op(len(self.ops), participant, kind, target, label))


def build_protocol(cell: Cell, faults: frozenset[str] = frozenset()) -> Program:
    """The upstream protocol for ``cell`` (three overlapped iterations), with ``faults``."""
    p = Program()
    fwd = FORWARD if cell.overlap else SCHEDULE
    relay = cell.is_spec and cell.overlap
    for i in range(ITERATIONS):
        if relay and i == 1:
            # process_prebuilt: a PD-decode request seeds its relay row on S (#35748).
            if "B9" not in faults:
                p.add(SCHEDULE, "wait_stream", fwd, "S.wait_stream(F) before prebuilt publish")
            p.add(SCHEDULE, "write", "new_seq_lens_buf[1]", "prebuilt publish on S")
            p.add(SCHEDULE, "record", "publish_ready", "publish_ready.record() on S")
            p.add(SCHEDULE, "write", "output_tokens_buf[1]", "prebuilt stash on S")
        p.add(SCHEDULE, "write", "req_to_token[0]", f"prepare B{i}: req_to_token rows")
        p.add(SCHEDULE, "write", f"seq_lens[{i}]", f"prepare B{i}: seq_lens tensor")
        if relay and i > 0:
            if "B13" in faults:
                p.add(SCHEDULE, "read", "accept_lens[0]", "filter_batch gathers accept_lens")
            if "B5" not in faults:
                p.add(SCHEDULE, "wait_event", "publish_ready", "S.wait(publish_ready)")
            for row in (0, 1) if i > 1 else (0,):
                p.add(SCHEDULE, "read", f"new_seq_lens_buf[{row}]", "resolve gather on S")
            if cell.needs_cpu_seq_lens:
                if "B5" not in faults:
                    p.add(D2H, "wait_event", "publish_ready", "D.wait(publish_ready)")
                p.add(D2H, "read", "new_seq_lens_buf[0]", "resolve D2H copy")
                p.add(HOST, "sync", D2H, "D.synchronize()")
        if cell.overlap:
            p.add(fwd, "wait_stream", SCHEDULE, "F.wait_stream(S) at launch")
        p.add(fwd, "read", "req_to_token[0]", f"F{i} reads req_to_token")
        p.add(fwd, "read", f"seq_lens[{i}]", f"F{i} reads seq_lens")
        late_fence = cell.is_spec and not cell.early_fence
        if not late_fence:
            p.add(fwd, "record", "read_done", "read-done event")
        if cell.is_spec:
            p.add(fwd, "write", "new_seq_lens_buf[0]", f"F{i} publish")
            p.add(fwd, "record", "publish_ready", "publish_ready.record() on F")
            # Draft extend builds its ForwardBatch from SB.seq_lens after the publish
            # (reference worker._draft_extend), so F still reads it past publish_ready.
            p.add(fwd, "read", f"seq_lens[{i}]", f"F{i} draft_extend reads seq_lens")
        if late_fence:
            p.add(fwd, "read", "req_to_token[0]", f"F{i} draft_extend reads req_to_token")
            p.add(fwd, "record", "read_done", "read-done event after draft_extend")
        if relay:
            # The stash, past the read-done point. Row 1 in F0 is the row a finished
            # request leaves and the prebuilt request of iteration 1 reuses (#35748).
            for row in (0, 1) if i == 0 else (0,):
                p.add(fwd, "write", f"output_tokens_buf[{row}]", f"F{i} stash")
            if "B13" in faults:
                p.add(fwd, "write", "accept_lens[0]", f"F{i} writes accept_lens")
        p.add(COPY, "wait_stream", fwd, "copy.wait_stream(F)")
        p.add(COPY, "write", f"result[{i}]", f"D2H of R{i}")
        p.add(COPY, "record", f"copy_done{i}", f"copy_done{i}")
        if cell.overlap:
            if "B8" not in faults:
                p.add(SCHEDULE, "wait_event", "read_done", "WAR fence S.wait(read_done)")
            ring = 1 if "B15" in faults else 2
            if i - ring >= 0:
                p.add(HOST, "free", f"seq_lens[{i - ring}]", "batch_record_buf drops a batch")
        processed = i - 1 if cell.overlap else i
        if processed >= 0:
            p.add(HOST, "sync", f"copy_done{processed}", f"copy_done{processed}.synchronize()")
            p.add(HOST, "read", f"result[{processed}]", f"process R{processed}")
    return p


@dataclass
class HbResult:
    invariant: str
    verdict: str
    seconds: float
    detail: str = ""
    schedule: list[str] = field(default_factory=list)


def _constraints(program: Program) -> tuple[dict[int, Term], list[Term], dict[int, int]]:
    """Times, ordering constraints, and for each wait the op index its event captured."""
    times = {op.index: zs.Int(f"t{op.index}") for op in program.ops}
    constraints: list[Term] = []
    last_on: dict[str, int] = {}
    captured: dict[str, int] = {}
    waited: dict[int, int] = {}
    for op in program.ops:
        t = times[op.index]
        host_last = last_on.get(HOST)
        if host_last is not None:
            constraints.append(t > times[host_last])  # enqueued after the host got here
        previous = last_on.get(op.participant)
        if previous is not None:
            constraints.append(t > times[previous])  # FIFO
        if op.kind == "record":
            source = last_on.get(op.participant)
            if source is not None:
                captured[op.target] = source
        elif op.kind == "wait_event" and op.target in captured:
            constraints.append(t > times[captured[op.target]])
            waited[op.index] = captured[op.target]
        elif op.kind in ("wait_stream", "sync"):
            stream = op.target if op.kind == "wait_stream" else op.target
            source = captured.get(stream) if op.kind == "sync" else last_on.get(stream)
            if op.kind == "sync" and source is None:
                source = last_on.get(stream)
            if source is not None:
                constraints.append(t > times[source])
        last_on[op.participant] = op.index
    return times, constraints, waited


def _accesses(program: Program) -> list[Op]:
    return [op for op in program.ops if op.kind in ("read", "write", "free")]


def _as_access(op: Op) -> Access:
    name, _, rest = op.target.partition("[")
    return Access(op.participant, op.index, op.kind, (name, int(rest.rstrip("]") or 0)),
                  op.label)


def _conflicting_pairs(program: Program) -> list[tuple[Op, Op, str]]:
    """(earlier, later, invariant ID) for each pair the host program orders one way."""
    pairs: list[tuple[Op, Op, str]] = []
    accesses = _accesses(program)
    for b_index, later in enumerate(accesses):
        for earlier in accesses[:b_index]:
            if earlier.target != later.target or earlier.participant == later.participant:
                continue
            if "write" not in (earlier.kind, later.kind) and "free" not in (
                    earlier.kind, later.kind):
                continue
            if later.kind == "free" and earlier.participant == SCHEDULE:
                continue  # the allocator reuses memory on S in FIFO order (spec.free)
            race = Race(_as_access(earlier), _as_access(later))
            pairs.append((earlier, later, classify_race(race)))
    return pairs


def _schedule(program: Program, raw_model: object) -> list[str]:
    times = [(zs.evaluate(raw_model, zs.Int(f"t{op.index}")), op) for op in program.ops]
    ordered = sorted(times, key=lambda pair: (int(pair[0] or 0), pair[1].index))
    return [f"t={t} {op.participant}: {op.label}" for t, op in ordered]


def prove_protocol(cell: Cell, faults: frozenset[str] = frozenset(),
                   timeout_ms: int = zs.DEFAULT_TIMEOUT_MS) -> list[HbResult]:
    """FM1 / FM3 / ST1 / ST2 / ST4 (pair orderings), FM2 (capture covers publishes), ST3."""
    program = build_protocol(cell, faults)
    times, constraints, waited = _constraints(program)
    by_id: dict[str, HbResult] = {}
    for earlier, later, invariant in _conflicting_pairs(program):
        outcome = zs.prove(constraints, times[earlier.index] < times[later.index], timeout_ms)
        result = by_id.setdefault(invariant, HbResult(invariant, zs.PROVED, 0.0))
        result.seconds += outcome.seconds
        if outcome.verdict != zs.PROVED and result.verdict == zs.PROVED:
            result.verdict = outcome.verdict
            result.detail = (f"{later.label} on {later.participant} can run before "
                             f"{earlier.label} on {earlier.participant}")
            if outcome.raw_model is not None:
                result.schedule = _schedule(program, outcome.raw_model)
    # FM2: each resolve wait's capture is ordered after the latest publish of every row.
    fm2 = HbResult("FM2", zs.PROVED, 0.0)
    publishes: list[Op] = []
    for op in program.ops:
        if op.kind == "write" and op.target.startswith("new_seq_lens_buf"):
            publishes = [p for p in publishes if p.target != op.target] + [op]
        if op.kind == "wait_event" and op.target == "publish_ready" and op.index in waited:
            capture = times[waited[op.index]]
            for publish in publishes:
                outcome = zs.prove(constraints, capture >= times[publish.index], timeout_ms)
                fm2.seconds += outcome.seconds
                if outcome.verdict != zs.PROVED and fm2.verdict == zs.PROVED:
                    fm2.verdict = outcome.verdict
                    fm2.detail = (f"publish_ready captured before {publish.label} on "
                                  f"{publish.participant}")
                    if outcome.raw_model is not None:
                        fm2.schedule = _schedule(program, outcome.raw_model)
    if cell.is_spec and cell.overlap:
        by_id["FM2"] = fm2
    # ST3: per iteration, the host blocks only on D2H and copy_done, within the budget.
    syncs = [op for op in program.ops if op.participant == HOST and op.kind == "sync"]
    per_iteration = len(syncs) / ITERATIONS
    on_schedule = [op for op in syncs if op.target == SCHEDULE]
    budget = compute_host_sync_budget(cell)
    ok = not on_schedule and per_iteration <= budget
    by_id["ST3"] = HbResult("ST3", zs.PROVED if ok else zs.COUNTEREXAMPLE, 0.0,
                            "" if ok else f"{per_iteration} syncs per iteration > {budget}")
    return [by_id[key] for key in sorted(by_id)]


def get_expected_ids(cell: Cell) -> tuple[str, ...]:
    """The IDs the protocol proof must produce in ``cell`` (a missing one is a failure)."""
    ids = ["ST3"]
    if cell.overlap:
        ids += ["ST1", "ST2", "ST4"]
    if cell.is_spec and cell.overlap:
        ids += ["FM1", "FM2", "FM3"]
    return tuple(sorted(ids))
