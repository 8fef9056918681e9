"""The upstream tier, one cell: sglang 0.5.23's own scheduler against the spec.

Runs inside the upstream environment (``./dev upstream``), one cell per process
(upstream allows one ``Scheduler`` per process);
:mod:`overlap_spec.harness.conformance.cli` starts one process per cell and merges their
JSON. Three checks, in one Hypothesis run:

1. **invariants**: the Hypothesis machine drives the real scheduler and checks every
   invariant the tier can judge at upstream's observation points, with upstream's own
   ``SchedulerInvariantChecker`` run after every iteration as an extra oracle (``UC``);
2. **findings**: a violation that matches a listed finding
   (``overlap_spec.harness.conformance.findings``) is recorded with a replayable script
   (minimised under the dev and thorough profiles) and does not stop the run; any other
   violation fails the cell, with its shrunk script;
3. **differential**: the reference follows the release on the same operations, compared
   after each; a difference on the allow-list is counted and the comparison goes on
   (every entry is about one field's value). The first unexplained difference, or a
   reference crash, fails the cell: that example stops being compared (the release goes
   on under the invariant checker), and the shortest such script is minimised and saved.
   A halting finding (U7) also stops the comparison of its example.

Until 2026-11-27 the differential was a second Hypothesis run that drove the release
again; one run does both and compares on every example.

``python -m overlap_spec.harness.conformance.tier --cell NAME --out DIR [--preset P] [--seed N]
[--profile P] [--sglang-src DIR]`` writes ``DIR/<cell>.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from overlap_spec.harness.conformance.findings import (
    KNOWN_FINDINGS,
    UPSTREAM_CHECKER_ID,
    UPSTREAM_NOT_APPLICABLE,
    AllowedDivergence,
    DivergenceContext,
    KnownFinding,
    get_allowed,
    match_finding,
)
from overlap_spec.harness.drive.cells import (
    format_sizes,
    get_share_examples,
    get_upstream_config,
    parse_sizes,
    split_preset,
)
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.script import (
    Continue,
    Iterate,
    Op,
    Script,
    apply_op,
    save_script,
)
from overlap_spec.harness.drive.stateful import (
    Profile,
    RunLog,
    get_machine_test,
    get_profile,
    make_machine,
)
from overlap_spec.harness.drive.witness import get_plan, replay_witnesses
from overlap_spec.spec.config import PRESETS, Cell, ModelConfig, get_cell
from overlap_spec.spec.interface import ObservableState
from overlap_spec.spec.invariants import INVARIANTS, InvariantViolation
from overlap_spec.spec.state import IterationChoices, Observation, TreeView
from overlap_spec.spec.units import PageId, RequestId

# The count of the release's idle-time checks that ran, in ``exercised`` beside UC's.
IDLE_CHECK_KEY = "UC at idle"
# The idle point after each example's last op: default-choice iterations (admit, decode,
# finish) until the loop has run on_idle's checks once, at most this many.
IDLE_POINT_ITERATIONS = 64


class UpstreamChecker(InvariantChecker):
    """The invariant checker with upstream's known findings set aside.

    A failing invariant that matches a listed finding is recorded (with the script so far)
    and checking goes on; anything else raises as usual. Invariants the tier cannot judge
    (:data:`UPSTREAM_NOT_APPLICABLE`) are not run.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.applicable = tuple(inv for inv in self.applicable
                                if inv.id not in UPSTREAM_NOT_APPLICABLE)
        self.findings: dict[str, int] = Counter()
        self.finding_scripts: dict[str, Script] = {}
        self.finding_messages: dict[str, str] = {}
        self.script: Script | None = None
        self.halted_by: str | None = None  # a listed finding after which nothing is judged

    def __call__(self, obs: Observation) -> None:
        self.observations += 1
        if self.halted_by is not None:
            return
        failures: list[InvariantViolation] = []
        for inv in self.applicable:
            try:
                count = inv.check(self.config, obs)
                if inv.id == "KV7" and count == 0:
                    # The release runs with the radix cache disabled, so KV7's witness
                    # (requests holding pages while others sit in the tree) cannot occur;
                    # here it is an observation where requests own pages to account for.
                    count = int(any(r.holds_kv and r.owned_pages for r in obs.requests))
                self.exercised[inv.id] += count
            except InvariantViolation as violation:
                known = match_finding(violation, self.config.cell)
                if known is None:
                    failures.append(violation)
                else:
                    self.record_finding(known, violation)
        if failures:
            first = failures[0]
            where = f" (op {obs.step_index}, cell {self.config.name})"
            raise InvariantViolation(first.invariant_id, first.message + where,
                                     all_ids=tuple(f.invariant_id for f in failures))

    def on_upstream_check(self, message: str | None, step_index: int) -> None:
        """Upstream's SchedulerInvariantChecker ran after an iteration (UC)."""
        if self.halted_by is not None:
            return
        self.exercised[UPSTREAM_CHECKER_ID] += 1
        if message is None:
            return
        violation = InvariantViolation(UPSTREAM_CHECKER_ID, f"(upstream's own checker): "
                                       f"{message} (op {step_index}, cell "
                                       f"{self.config.name})")
        known = match_finding(violation, self.config.cell)
        if known is None:
            raise violation
        self.record_finding(known, violation)

    def on_upstream_idle_check(self, message: str | None, step_index: int) -> None:
        """The release's idle-time checks ran (``Scheduler.on_idle`` with the scheduler fully
        idle: pools, req_to_token rows, byte accounting): UC at idle, counted apart too."""
        if self.halted_by is not None:
            return
        self.exercised[IDLE_CHECK_KEY] += 1
        self.on_upstream_check(None if message is None else f"at idle (on_idle): {message}",
                               step_index)

    def record_finding(self, known: KnownFinding, violation: InvariantViolation) -> None:
        if known.halts:
            self.halted_by = known.id
        self.findings[known.id] += 1
        if known.id not in self.finding_scripts and self.script is not None:
            self.finding_scripts[known.id] = replace(self.script, ops=list(self.script.ops))
            self.finding_messages[known.id] = str(violation)


def get_excused_claims(checker: UpstreamChecker) -> set[str] | None:
    """What a witness's run on the release need not have exercised: the invariants of the
    listed findings it met (the release fails them there, set aside), or everything after
    a halting finding (None: nothing after it is judged)."""
    if checker.halted_by is not None:
        return None
    return {known.invariant for known in KNOWN_FINDINGS if known.id in checker.findings}


# ---------------------------------------------------------------------- findings
def get_invariant_claim(invariant_id: str) -> str:
    if invariant_id == UPSTREAM_CHECKER_ID:
        return "UC: upstream's own SchedulerInvariantChecker passes"
    from overlap_spec.spec.invariants import get_invariant

    return get_invariant(invariant_id).describe()


def replay_on_upstream(script: Script) -> UpstreamChecker | InvariantViolation:
    """Replay a script on upstream: the checker (with its findings), or the violation."""
    from overlap_spec.upstream.adapter import make_upstream

    config = script.get_config()
    checker = UpstreamChecker(config)
    checker.script = replace(script, ops=[])
    model = make_upstream(config, frozenset(), checker)
    admitted: list[RequestId] = []
    for index, op in enumerate(script.ops):
        checker.script.ops.append(op)
        model.set_step_index(index)
        try:
            apply_op(model, op, admitted)
        except InvariantViolation as violation:
            return violation
    return checker


def minimize_finding(script: Script, finding_id: str, budget: int = 200) -> Script:
    """The smallest script (greedy) that still shows the finding on upstream."""
    from overlap_spec.harness.drive.minimize import minimize_script

    def still_fails(trial: Script) -> bool:
        outcome = replay_on_upstream(trial)
        return isinstance(outcome, UpstreamChecker) and finding_id in outcome.findings

    return minimize_script(script, finding_id, budget=budget, still_fails=still_fails)


# ---------------------------------------------------------------------- differential
def normalize_slots(state: ObservableState, page_size: int) -> ObservableState:
    """Rows with pages renumbered by first appearance (request order), offsets kept.

    Which free page an allocator hands out is its own business (upstream keeps page 0 as
    padding and sorts its free list on merge); what both must agree on is the layout:
    how many pages each row spans, which positions share a page, and that no two requests
    share one. Batches are compared as they are, member order included (the reference
    keeps the retraction policy's order after a retraction, as the release does).
    """
    labels: dict[int, int] = {}
    requests = []
    for req in state.requests:
        row = []
        for slot in req.req_to_token:
            page = labels.setdefault(slot // page_size, len(labels))
            row.append(page * page_size + slot % page_size)
        requests.append(replace(req, req_to_token=tuple(row)))
    return replace(state, requests=tuple(requests), tree=_normalize_tree(state.tree, labels))


def _normalize_tree(tree: TreeView | None, labels: dict[int, int]) -> TreeView | None:
    """A radix cell's tree with its nodes named by their whole key from the root (node ids
    are each implementation's own) and ordered by it, and its pages renumbered as the rows
    were (a page no row reaches by first appearance in that order): what both must agree
    on is the nodes' keys and boundaries, their locks, which rows share which node's pages,
    and the two sizes."""
    if tree is None:
        return None
    keyed = sorted(((tuple(k for n in tree.get_path(node.id) for k in n.key), node)
                    for node in tree.nodes), key=lambda item: repr(item[0]))
    ids = {node.id: index for index, (_, node) in enumerate(keyed)}
    nodes = tuple(replace(node, id=ids[node.id],
                          parent=None if node.parent is None else ids[node.parent], key=key,
                          pages=tuple(PageId(labels.setdefault(p, len(labels)))
                                      for p in node.pages))
                  for key, node in keyed)
    return replace(tree, nodes=nodes)


# RequestState fields the upstream side reports as None (not reported), skipped here.
# kv_contents (what each forward wrote where, compared reference vs gpu_impl): the stand-in
# worker (upstream/worker.py) checks each write against the release's row and writes no KV
# buffer, and a column the release allocated but no forward wrote shows a reused page's old
# content, which hangs on which free page the allocator hands out; that differs from the
# reference's by design (normalize_slots). docs/upstream-tier.md.
NOT_REPORTED_UPSTREAM = frozenset({"kv_contents"})


def get_differences(reference: ObservableState, upstream: ObservableState, page_size: int = 1
                    ) -> list[tuple[str, Any, Any]]:
    """Every differing field as (path, reference value, upstream value), rows and a radix
    cell's tree compared after :func:`normalize_slots`. Outside radix cells the tree's
    page count is not compared: with the release's tree on under
    ``upstream.fields.is_radix_force_miss`` it dedups identical keys and evicts at a
    retraction and by nodes, none of which the reference's sink models
    (``docs/upstream-radix-sharing.md`` section 5, step 0). A request field of
    :data:`NOT_REPORTED_UPSTREAM` is skipped where the upstream side leaves it None."""
    reference = normalize_slots(reference, page_size)
    upstream = normalize_slots(upstream, page_size)
    out: list[tuple[str, Any, Any]] = []
    if len(reference.requests) != len(upstream.requests):
        return [("requests", len(reference.requests), len(upstream.requests))]
    for ref_req, up_req in zip(reference.requests, upstream.requests, strict=True):
        for f in fields(ref_req):
            a, b = getattr(ref_req, f.name), getattr(up_req, f.name)
            if b is None and f.name in NOT_REPORTED_UPSTREAM:
                continue
            if a != b:
                out.append((f"request r{ref_req.rid}.{f.name}", a, b))
    for name in ("running", "last_batch"):
        a_batch, b_batch = getattr(reference, name), getattr(upstream, name)
        if a_batch is None or b_batch is None:
            if a_batch != b_batch:
                out.append((name, a_batch, b_batch))
            continue
        for f in fields(a_batch):
            a, b = getattr(a_batch, f.name), getattr(b_batch, f.name)
            if a != b:
                out.append((f"{name}.{f.name}", a, b))
    for name in ("free_pages", "kv_write_faults", "accept_counters", "new_token_ratio",
                 "batch_is_full", "tree"):
        a, b = getattr(reference, name), getattr(upstream, name)
        if a != b:
            out.append((name, a, b))
    return out


def explain(differences: list[tuple[str, Any, Any]], ctx: DivergenceContext
            ) -> tuple[list[AllowedDivergence], tuple[str, Any, Any] | None]:
    """The allow-list entries that explain the differences, and the first unexplained one."""
    used: list[AllowedDivergence] = []
    for path, ref_value, up_value in differences:
        entry = get_allowed(path, ref_value, up_value, ctx)
        if entry is None:
            return used, (path, ref_value, up_value)
        if entry not in used:
            used.append(entry)
    return used, None


def as_the_release_read_it(op: Op, processed_early: bool) -> Op:
    """The operation for the reference, with ``disable_overlap`` as the release read it.

    The environment's ``disable_overlap`` is, for the reference, "process the pending result
    before launching" (upstream's ``is_disable_overlap_for_batch``, whichever of its paths).
    The release is driven through one of those paths, SGLANG_DISABLE_CONSECUTIVE_PREFILL_
    OVERLAP, which it takes only between two consecutive prefills (grammar sync is not
    driven). The release runs the operation first; the reference then gets the decision
    the release's loop made (``UpstreamScheduler.processed_early``), so both process early
    in the same iterations.
    """
    if isinstance(op, Iterate) and op.choices.disable_overlap != processed_early:
        return Iterate(replace(op.choices, disable_overlap=processed_early))
    return op


def get_release_faults(cell: Cell) -> frozenset[str]:
    """The catalogue's bugs that are the release's own behaviour in ``cell``
    (``Bug.current_upstream``): the reference the differential compares runs with them."""
    from overlap_spec.harness.catalogue import BUGS

    return frozenset(bug.id for bug in BUGS if bug.current_upstream and bug.applies(cell))


class ReferenceCrash(Exception):
    """The reference raised where the release ran on: a failure of the differential."""


class UpstreamPair:
    """The release and the reference in lock step; :meth:`apply` compares after each op.

    ``upstream`` is the release's adapter when the caller made it (the tier's run gives it
    its invariant checker); otherwise the pair makes one with no observer.
    """

    def __init__(self, config: ModelConfig, upstream: Any = None,
                 up_admitted: list[RequestId] | None = None) -> None:
        from overlap_spec.reference.scheduler import Scheduler as ReferenceScheduler
        from overlap_spec.upstream.adapter import make_upstream

        self.config = config
        self.upstream = make_upstream(config, frozenset(), None) if upstream is None else upstream
        self.faults = get_release_faults(config.cell)
        self.reference = ReferenceScheduler(config, self.faults, None)
        self.ref_admitted: list[RequestId] = []
        self.up_admitted: list[RequestId] = [] if up_admitted is None else up_admitted
        self.steps = 0

    def run_release(self, op: Op) -> None:
        """The release's half of one step (its observer may raise a violation)."""
        self.upstream.set_step_index(self.steps)
        self.steps += 1
        apply_op(self.upstream, op, self.up_admitted)

    def follow(self, op: Op) -> tuple[list[str], tuple[str, Any, Any] | None]:
        """The reference's half, then the comparison: (allowed entries used, the unexplained
        difference or None). Every allowed entry is about one field's value: the runs stay
        in step."""
        self.reference.set_step_index(self.steps - 1)
        try:
            apply_op(self.reference, as_the_release_read_it(op, self.upstream.processed_early),
                     self.ref_admitted)
        except Exception as error:  # noqa: BLE001 - the release ran on: a failure
            raise ReferenceCrash(f"{type(error).__name__}: {str(error)[:300]}") from error
        ref_state = self.reference.get_observable_state()
        up_state = self.upstream.get_observable_state()
        differences = get_differences(ref_state, up_state, self.config.page_size)
        if not differences:
            return [], None
        ctx = DivergenceContext(ref_state, up_state, self.upstream.retracted_in_operation,
                                self.config.cell.is_spec)
        used, unexplained = explain(differences, ctx)
        return [entry.id for entry in used], unexplained

    def apply(self, op: Op) -> tuple[list[str], tuple[str, Any, Any] | None]:
        self.run_release(op)
        return self.follow(op)


def replay_differential(script: Script) -> tuple[int, dict[str, Any] | None, list[str]]:
    """Replay a differential script: (ops compared, the unexplained divergence, the allowed
    entries that explained a difference). A reference crash is a divergence whose field
    is ``reference crashed``."""
    pair = UpstreamPair(script.get_config())
    explained: list[str] = []
    for index, op in enumerate(script.ops):
        try:
            used, unexplained = pair.apply(op)
        except ReferenceCrash as crash:
            return index + 1, {"step": index, "field": "reference crashed",
                               "reference": str(crash), "upstream": "ran"}, explained
        explained += [e for e in used if e not in explained]
        if unexplained is not None:
            path, ref_value, up_value = unexplained
            return index + 1, {"step": index, "field": path, "reference": repr(ref_value),
                               "upstream": repr(up_value)}, explained
    return len(script.ops), None, explained


def _field_kind(path: str) -> str:
    """A divergence's field with the request's id left out (minimising renumbers them)."""
    return re.sub(r"\br\d+\.", "r*.", path)


def minimize_divergence(script: Script, path: str, budget: int = 200) -> Script:
    """The smallest script (greedy) on which the differential still diverges at a field of
    the same kind (or the reference still crashes)."""
    from overlap_spec.harness.drive.minimize import minimize_script

    kind = _field_kind(path)

    def still_fails(trial: Script) -> bool:
        divergence = replay_differential(trial)[1]
        return divergence is not None and _field_kind(divergence["field"]) == kind

    return minimize_script(script, kind, budget=budget, still_fails=still_fails)


@dataclass
class DifferentialReport:
    """What the differential half of a cell's run saw: examples, the operations compared
    and agreed, the allow-list entries used, the first divergence (with the script up to
    it) or reference crash, and the examples whose comparison stopped early and why."""

    examples: int = 0
    operations: int = 0  # operations after which both states were compared and agreed
    explained: Counter[str] = field(default_factory=Counter)
    divergence: dict[str, Any] | None = None
    divergence_script: Script | None = None
    error: str | None = None
    stopped: Counter[str] = field(default_factory=Counter)
    # Witnesses of what was compared: agreed operations by kind (admit, iterate, abort), and
    # the iterations where the release processed the last result before launching.
    kinds: Counter[str] = field(default_factory=Counter)
    processed_early: int = 0

    def record(self, script: Script, step: int, path: str, reference: str, upstream: str
               ) -> None:
        """Keep the shortest divergence seen (``path`` "reference crashed" for a crash)."""
        if self.divergence_script is not None and len(script.ops) >= len(
                self.divergence_script.ops):
            return
        self.divergence_script = replace(script, ops=list(script.ops))
        self.divergence = {"step": step, "field": path, "reference": reference,
                           "upstream": upstream}


def finish_differential(report: DifferentialReport, config: ModelConfig, seed: int,
                        save_dir: Path, minimize: bool, replay: bool = True) -> None:
    """Minimise (``minimize``) and save the divergence the run recorded, and say where it
    is. With ``replay`` (not after the release crashed) the saved script is replayed on
    its own; ``replays`` says whether that showed the divergence again (a divergence that
    does not is still a failure, never agreement)."""
    if report.divergence is None or report.divergence_script is None:
        return
    from overlap_spec.harness.drive.script import op_to_json

    script = replace(report.divergence_script, seed=seed,
                     implementation="upstream-differential")
    if replay:
        if minimize:
            script = minimize_divergence(script, report.divergence["field"])
        compared, divergence, _ = replay_differential(script)
        if divergence is not None:
            script = replace(script, ops=script.ops[:compared])
            report.divergence = divergence
        report.divergence["replays"] = divergence is not None
    path = save_script(script, save_dir / f"{config.cell.name}-differential.json")
    report.divergence["op"] = op_to_json(script.ops[report.divergence["step"]])
    report.divergence["script"] = str(path)
    if report.divergence["field"] == "reference crashed":
        report.error = f"the reference crashed: {report.divergence['reference']}"


# ---------------------------------------------------------------------- one cell
# Sequences per cell on the release, where the profile's own count is more than the tier's
# time a cell allows: each step drives the release and follows it with the reference, about
# three times a reference run, and `check` runs the tier within its five minutes.
UPSTREAM_EXAMPLES = {"quick": 30, "ci": 45}
# The profiles whose run minimises each listed finding it met (each trial drives the
# release again: about half a spec cell's time).
MINIMISED_FINDING_PROFILES = frozenset({"dev", "thorough"})


def get_upstream_examples(profile: Profile) -> int:
    return UPSTREAM_EXAMPLES.get(profile.name, profile.max_examples)


def run_cell(config: ModelConfig, profile: Profile, seed: int, save_dir: Path,
             share: float = 1.0) -> dict[str, Any]:
    """Everything the tier says about one cell, as the report's JSON fragment; ``share``:
    the cell's share of the profile's sequences (``cells.get_upstream_shares``)."""
    from overlap_spec.upstream.session import UpstreamCrash, get_death, is_drivable

    started = time.perf_counter()
    reason = is_drivable(config)
    if reason is not None:
        return {"verdict": "n/a", "reason": reason, "invariants": {}, "findings": [],
                "differential": {"verdict": "n/a", "reason": reason, "divergences": []}}
    log = RunLog()
    checkers: list[UpstreamChecker] = []

    def factory(cfg: ModelConfig) -> InvariantChecker:
        checker = UpstreamChecker(cfg)
        checkers.append(checker)
        return checker

    machine = make_machine(config, frozenset(), "upstream", log, checker_factory=factory)
    diff = DifferentialReport()
    idle: Counter[str] = Counter()

    class CellMachine(machine):  # type: ignore[valid-type, misc]
        """One run, both checks: the release under the invariant checker, and the
        reference following it op by op until the first divergence, a reference crash
        or a halting finding (after which the release's state is not judged)."""

        def __init__(self) -> None:
            super().__init__()
            self.checker.script = self.script
            self.pair = UpstreamPair(config, self.model, self.admitted)
            self.comparing = True
            self.failed = False
            diff.examples += 1

        def teardown(self) -> None:
            try:
                if not self.failed and self.checker.halted_by is None:
                    self.make_idle()
            finally:
                super().teardown()

        def make_idle(self) -> None:
            """The idle point: after the example's last op, iterate with the default choices
            until the release's loop has run its idle-time checks (on_idle, the scheduler
            fully idle). These iterations are the script's ops: judged, compared with the
            reference and replayed like any other. Hypothesis draws nothing here, so a seed
            draws what it drew before. An example that ended paused is resumed first (a
            ``continue`` op): a paused loop never reaches on_idle."""
            release = self.pair.upstream
            before = release.idle_checks_ran
            if release.scheduler._engine_paused:
                self._apply(Continue())
            for _ in range(IDLE_POINT_ITERATIONS):
                if release.idle_checks_ran > before:
                    idle["reached"] += 1
                    return
                self._apply(Iterate(IterationChoices()))
            idle["reached" if release.idle_checks_ran > before else "not reached"] += 1

        def _apply(self, op: Op) -> None:
            self.script.ops.append(op)
            try:
                self.pair.run_release(op)  # a new finding raises here: Hypothesis shrinks it
            except BaseException:
                self.failed = True  # no idle point after a failed op: teardown leaves it
                raise
            if not self.comparing:
                return
            if self.checker.halted_by is not None:
                self.comparing = False
                diff.stopped[f"after {self.checker.halted_by}"] += 1
                return
            step = len(self.script.ops) - 1
            try:
                used, unexplained = self.pair.follow(op)
            except ReferenceCrash as crash:
                self.comparing = False
                diff.stopped["reference crashed"] += 1
                diff.record(self.script, step, "reference crashed", str(crash), "ran")
                return
            if unexplained is not None:
                self.comparing = False
                diff.stopped["divergence"] += 1
                path, ref_value, up_value = unexplained
                diff.record(self.script, step, path, repr(ref_value), repr(up_value))
                return
            for entry in used:
                diff.explained[entry] += 1
            diff.operations += 1
            diff.kinds[type(op).__name__.lower()] += 1
            if isinstance(op, Iterate):
                diff.processed_early += self.pair.upstream.processed_early

    examples = get_share_examples(get_upstream_examples(profile), share)
    test = get_machine_test(CellMachine, examples, profile.step_count, seed, True)
    # The cell's deterministic witnesses first (those the release can be driven through),
    # so a witness never depends on the seed (harness.drive.witness).
    plan = get_plan(config)
    claimed = frozenset(i for w in plan.witnesses if w.upstream for i in w.claims)
    # The reference itself failing the seeded search (sizes outside the corpus) leaves no
    # ground for an n/a: the cell fails, saying so.
    witness_failure = None if plan.failure is None else (
        "the reference fails the seeded witness search at these sizes: overlap-spec review "
        f"--cells {config.cell.name} --sizes {format_sizes(split_preset(config.preset)[1])} "
        "shows it")
    witnesses_ran, witnesses_lost = 0, dict[int, list[str]]()
    violation: InvariantViolation | None = None
    crash: str | None = None
    failure_script: Path | None = None
    try:
        witnesses_ran, witnesses_lost = replay_witnesses(
            CellMachine, plan, upstream=True, ignore=frozenset(UPSTREAM_NOT_APPLICABLE),
            excused=get_excused_claims)
        test()
    except InvariantViolation as error:
        violation = error
        script = log.last_script
        if script is not None:
            script.seed = seed
            failure_script = save_script(script, save_dir / f"{config.cell.name}-new.json")
    except UpstreamCrash as error:  # raised as it is outside Hypothesis (a witness's run)
        crash = f"the release crashed: {str(error)[:400]}"
    except Exception as error:  # noqa: BLE001 - a crash of the tier is a failure
        # A release that crashed leaves its scheduler dead: Hypothesis's replay of the
        # example then fails before it draws (FlakyStrategyDefinition), hiding the crash.
        death = get_death()
        crash = (f"the release crashed: {death[:400]}" if death is not None
                 else f"{type(error).__name__}: {str(error)[:400]}")
    seconds_check = time.perf_counter() - started

    findings_seen: dict[str, int] = Counter()
    finding_scripts: dict[str, Script] = {}
    messages: dict[str, str] = {}
    for checker in checkers:
        findings_seen.update(checker.findings)
        for key, value in checker.finding_scripts.items():
            if key not in finding_scripts or len(value.ops) < len(finding_scripts[key].ops):
                finding_scripts[key] = value
                messages[key] = checker.finding_messages[key]

    findings: list[dict[str, Any]] = []
    for known in KNOWN_FINDINGS:
        if known.id not in finding_scripts:
            continue
        script = finding_scripts[known.id]
        script.seed = seed
        script.implementation = "upstream"
        # Each minimising trial drives sglang's scheduler again: quick (a reviewer's
        # `review --sglang-src`) and ci (`check`, where the same listed findings recur in
        # every spec cell) save a listed finding as found (the shortest the run met), still
        # replayable; dev and thorough minimise it.
        if crash is None and profile.name in MINIMISED_FINDING_PROFILES:
            script = minimize_finding(script, known.id)
        path = save_script(script, save_dir / f"{config.cell.name}-{known.id}.json")
        findings.append({"id": known.id, "invariant": known.invariant, "cell": config.cell.name,
                         "script": str(path), "ops": len(script.ops),
                         "upstream": known.upstream, "expected": known.expected,
                         "actual": messages[known.id], "listed": True,
                         "occurrences": findings_seen[known.id]})
    if violation is not None:
        failing = getattr(violation, "script", None)
        findings.append({"id": None, "invariant": violation.invariant_id,
                         "cell": config.cell.name,
                         "script": None if failure_script is None else str(failure_script),
                         "ops": None if failing is None else len(failing.ops),
                         "upstream": getattr(violation, "upstream_location", ""),
                         "expected": get_invariant_claim(violation.invariant_id),
                         "actual": str(violation), "listed": False, "occurrences": 1})

    invariants: dict[str, str] = {}
    na_reasons: dict[str, str] = {}
    for inv in INVARIANTS:
        if not inv.applies(config.cell):
            invariants[inv.id] = "n/a"
        elif inv.id in UPSTREAM_NOT_APPLICABLE:
            invariants[inv.id] = "n/a"
        elif violation is not None and inv.id in violation.all_ids:
            invariants[inv.id] = "fail"
        elif any(f["invariant"] == inv.id and f["listed"] for f in findings):
            invariants[inv.id] = "finding"
        elif log.exercised[inv.id] == 0 and (inv.id in claimed or witness_failure):
            invariants[inv.id] = "vacuous"
        elif log.exercised[inv.id] == 0:
            invariants[inv.id] = "n/a"
            na_reasons[inv.id] = plan.na.get(inv.id) or (
                "no witness the release can be driven through claims it (the corpus's need "
                "a PD-prebuilt arrival or a rung switch) and the search reached none")
        else:
            invariants[inv.id] = "pass"
    if violation is not None and UPSTREAM_CHECKER_ID in violation.all_ids:
        invariants[UPSTREAM_CHECKER_ID] = "fail"
    else:
        witnessed = log.exercised[UPSTREAM_CHECKER_ID]
        invariants[UPSTREAM_CHECKER_ID] = "pass" if witnessed else "vacuous"

    # Each minimising trial drives the release again; the quick profile saves as found
    # (replayed once); after a crash of the release nothing is replayed.
    finish_differential(diff, config, seed, save_dir, profile.name != "quick",
                        replay=crash is None)
    verdict = "pass"
    reason = None
    if diff.divergence is not None or diff.error is not None:
        verdict = "fail"
    elif crash is not None:
        verdict, reason = "n/a", "the scheduler crashed in the run"
    elif violation is not None:
        verdict, reason = "incomplete", "the run stopped at a new invariant violation"
    elif diff.operations == 0:
        verdict = "vacuous"
    differential: dict[str, Any] = {
        "verdict": verdict, "examples": diff.examples, "operations_agreed": diff.operations,
        "operations_by_kind": dict(diff.kinds), "processed_early": diff.processed_early,
        "explained": dict(diff.explained), "stopped": dict(diff.stopped),
        "reference_faults": sorted(get_release_faults(config.cell)),
        "divergences": [] if diff.divergence is None else [diff.divergence],
        "error": diff.error,
    }
    if reason is not None:
        differential["reason"] = reason
    vacuous = [i for i, v in invariants.items() if v == "vacuous"]
    failed = (violation is not None or crash is not None or bool(vacuous)
              or witness_failure is not None or differential["verdict"] not in ("pass",))
    return {
        "verdict": "fail" if failed else "pass",
        "reason": crash or witness_failure or (f"vacuous: {', '.join(vacuous)}" if vacuous
                                               else None),
        "invariants": invariants,
        "exercised": dict(log.exercised),
        # the sizes it ran at, where not the preset's (a serving-default cell's chunking)
        "sizes": split_preset(config.preset)[1],
        # operations per mechanism the release's observations showed
        "mechanisms": dict(log.mechanisms),
        # witness index -> the claims the release no longer met with the witness's ops
        "witnesses": {"source": plan.source, "ran": witnesses_ran,
                      "lost": {str(k): v for k, v in witnesses_lost.items()},
                      "not_applicable": na_reasons},
        "runs": log.runs,
        # The idle points made after each example's last op, and the release's idle-time
        # checks that ran (there and wherever the loop idled): "skipped" when none ran.
        "idle": {"points": idle["reached"], "not_reached": idle["not reached"],
                 "checks_ran": log.exercised[IDLE_CHECK_KEY],
                 "verdict": ("fail" if violation is not None
                             and "at idle (on_idle)" in str(violation)
                             else "pass" if log.exercised[IDLE_CHECK_KEY] else "skipped")},
        "findings": findings,
        "differential": differential,
        # The Hypothesis run (both checks), then minimising what it found.
        "seconds": {"run": round(seconds_check, 1),
                    "minimise": round(time.perf_counter() - started - seconds_check, 1)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m overlap_spec.harness.conformance.tier")
    parser.add_argument("--cell", required=True)
    parser.add_argument("--preset", default="minimal", choices=sorted(PRESETS))
    parser.add_argument("--sizes", default="", help="NAME=N,... in place of the preset's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sglang-src", type=Path, default=None)
    parser.add_argument("--share", type=float, default=1.0,
                        help="the cell's share of the profile's sequences")
    args = parser.parse_args(argv)
    from overlap_spec.upstream.bootstrap import UpstreamUnavailable, load_sglang

    try:
        source = load_sglang(args.sglang_src)
        sizes = parse_sizes(args.sizes) if args.sizes else {}
        config = get_upstream_config(get_cell(args.cell), args.preset, sizes)
        profile = get_profile(args.profile)
        args.out.mkdir(parents=True, exist_ok=True)
        result = run_cell(config, profile, args.seed, args.out, args.share)
    except (UpstreamUnavailable, KeyError, ValueError, argparse.ArgumentTypeError) as error:
        message = error.args[0] if error.args else str(error)
        print(f"overlap-spec upstream: {message}", file=sys.stderr)
        return 2
    result["sglang"] = {"version": source.version, "source": source.source}
    (args.out / f"{args.cell}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
