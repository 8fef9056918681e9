"""The upstream tier, one cell: sglang 0.5.23's own scheduler against the spec.

Runs inside the upstream environment (``./dev upstream``), one cell per process
(upstream allows one ``Scheduler`` per process);
:mod:`overlap_spec.harness.conformance.cli` starts one process per cell and merges their
JSON. Three checks:

1. **invariants**: the Hypothesis machine drives the real scheduler and checks every
   invariant the tier can judge at upstream's observation points, with upstream's own
   ``SchedulerInvariantChecker`` run after every iteration as an extra oracle (``UC``);
2. **findings**: a violation that matches a listed finding
   (``overlap_spec.harness.conformance.findings``) is recorded with a minimised replayable
   script and does not stop the run; any other violation fails the cell, with its shrunk
   script;
3. **differential**: the reference and upstream in lock step on the same operations; every
   divergence is on the allow-list (counted) or fails the cell with its script. An entry
   about one field (a value reported differently) lets the comparison go on; one that
   explains a whole operation (the runs did different things) ends that example.

``python -m overlap_spec.harness.conformance.tier --cell NAME --out DIR [--preset P] [--seed N]
[--profile P] [--sglang-src DIR]`` writes ``DIR/<cell>.json``.
"""

from __future__ import annotations

import argparse
import json
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
from overlap_spec.harness.drive.cells import make_preset, parse_sizes
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.script import Iterate, Op, Script, apply_op, save_script
from overlap_spec.harness.drive.stateful import (
    Profile,
    RunLog,
    get_machine_test,
    get_profile,
    make_machine,
)
from overlap_spec.spec.config import PRESETS, ModelConfig, get_cell
from overlap_spec.spec.interface import ObservableState
from overlap_spec.spec.invariants import INVARIANTS, InvariantViolation
from overlap_spec.spec.state import Observation
from overlap_spec.spec.units import RequestId


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

    def record_finding(self, known: KnownFinding, violation: InvariantViolation) -> None:
        if known.halts:
            self.halted_by = known.id
        self.findings[known.id] += 1
        if known.id not in self.finding_scripts and self.script is not None:
            self.finding_scripts[known.id] = replace(self.script, ops=list(self.script.ops))
            self.finding_messages[known.id] = str(violation)


# ---------------------------------------------------------------------- findings
def get_invariant_claim(invariant_id: str) -> str:
    if invariant_id == UPSTREAM_CHECKER_ID:
        return "UC: upstream's own SchedulerInvariantChecker passes"
    from overlap_spec.spec.invariants import get_invariant

    return " ".join((get_invariant(invariant_id).check.__doc__ or "").split())


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
@dataclass
class DifferentialReport:
    examples: int = 0
    operations: int = 0  # operations after which both states were compared and agreed
    explained: Counter[str] = field(default_factory=Counter)
    divergence: dict[str, Any] | None = None
    error: str | None = None


class _Unexplained(Exception):
    def __init__(self, divergence: dict[str, Any]) -> None:
        super().__init__(divergence["field"])
        self.divergence = divergence


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
    return replace(state, requests=tuple(requests))


def get_differences(reference: ObservableState, upstream: ObservableState, page_size: int = 1
                    ) -> list[tuple[str, Any, Any]]:
    """Every differing field as (path, reference value, upstream value), rows compared
    after :func:`normalize_slots`."""
    reference = normalize_slots(reference, page_size)
    upstream = normalize_slots(upstream, page_size)
    out: list[tuple[str, Any, Any]] = []
    if len(reference.requests) != len(upstream.requests):
        return [("requests", len(reference.requests), len(upstream.requests))]
    for ref_req, up_req in zip(reference.requests, upstream.requests, strict=True):
        for f in fields(ref_req):
            a, b = getattr(ref_req, f.name), getattr(up_req, f.name)
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
                 "batch_is_full"):
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


def normalize_differential_op(op: Op) -> Op:
    """The operation as the differential applies it: never ``disable_overlap``.

    The two read that choice differently: the reference processes the pending result before
    launching any batch, the release only between two consecutive prefills
    (SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP; grammar sync is not driven). Until the
    reference says what the release does, the differential does not ask for it; the
    invariant check does.
    """
    if isinstance(op, Iterate) and op.choices.disable_overlap:
        return Iterate(replace(op.choices, disable_overlap=False))
    return op


class UpstreamPair:
    """The reference and the release in lock step; :meth:`apply` compares after each op."""

    def __init__(self, config: ModelConfig) -> None:
        from overlap_spec.reference.scheduler import Scheduler as ReferenceScheduler
        from overlap_spec.upstream.adapter import make_upstream

        self.config = config
        self.reference = ReferenceScheduler(config, frozenset(), None)
        self.upstream = make_upstream(config, frozenset(), None)
        self.ref_admitted: list[RequestId] = []
        self.up_admitted: list[RequestId] = []
        self.steps = 0

    def apply(self, op: Op) -> tuple[list[str], tuple[str, Any, Any] | None]:
        """Apply one op to both: (allowed entries used, the unexplained difference or None).
        Every allowed entry is about one field's value: the runs stay in step."""
        step = self.steps
        self.steps += 1
        self.reference.set_step_index(step)
        self.upstream.set_step_index(step)
        apply_op(self.reference, op, self.ref_admitted)
        apply_op(self.upstream, op, self.up_admitted)
        ref_state = self.reference.get_observable_state()
        up_state = self.upstream.get_observable_state()
        differences = get_differences(ref_state, up_state, self.config.page_size)
        if not differences:
            return [], None
        ctx = DivergenceContext(ref_state, up_state, self.upstream.retracted_in_operation,
                                self.config.cell.is_spec)
        used, unexplained = explain(differences, ctx)
        return [entry.id for entry in used], unexplained


def replay_differential(script: Script) -> tuple[int, dict[str, Any] | None, list[str]]:
    """Replay a differential script: (ops compared, the unexplained divergence, the allowed
    entries that explained a difference)."""
    pair = UpstreamPair(script.get_config())
    explained: list[str] = []
    for index, op in enumerate(script.ops):
        op = normalize_differential_op(op)
        used, unexplained = pair.apply(op)
        explained += [e for e in used if e not in explained]
        if unexplained is not None:
            path, ref_value, up_value = unexplained
            return index + 1, {"step": index, "field": path, "reference": repr(ref_value),
                               "upstream": repr(up_value)}, explained
    return len(script.ops), None, explained


def run_differential_cell(config: ModelConfig, profile: Profile, seed: int,
                          save_dir: Path, examples: int) -> DifferentialReport:
    """Reference vs upstream on Hypothesis-generated operations (the upstream domain)."""
    base = make_machine(config, frozenset(), "upstream")
    report = DifferentialReport()

    class DifferentialMachine(base):  # type: ignore[valid-type, misc]
        def __init__(self) -> None:
            super().__init__()
            report.examples += 1
            self.pair = UpstreamPair(config)

        def _apply(self, op: Op) -> None:
            op = normalize_differential_op(op)
            self.script.ops.append(op)
            used, unexplained = self.pair.apply(op)
            if unexplained is not None:
                path, ref_value, up_value = unexplained
                raise _Unexplained({"step": len(self.script.ops) - 1, "op": op, "field": path,
                                    "reference": repr(ref_value), "upstream": repr(up_value),
                                    "script": replace(self.script, ops=list(self.script.ops))})
            for entry in used:
                report.explained[entry] += 1
            report.operations += 1

    DifferentialMachine.__name__ = f"UpstreamDifferential[{config.name}]"
    test = get_machine_test(DifferentialMachine, examples, profile.step_count, seed, True)
    try:
        test()
    except _Unexplained as failure:
        div = failure.divergence
        script: Script = div.pop("script")
        script.seed = seed
        script.implementation = "upstream-differential"
        path = save_script(script, save_dir / f"{config.cell.name}-differential.json")
        from overlap_spec.harness.drive.script import op_to_json

        div["op"] = op_to_json(div["op"])
        div["script"] = str(path)
        report.divergence = div
    except Exception as error:  # noqa: BLE001 - a crash is a failure, never agreement
        report.error = f"{type(error).__name__}: {str(error)[:400]}"
    return report


# ---------------------------------------------------------------------- one cell
def run_cell(config: ModelConfig, profile: Profile, seed: int, save_dir: Path) -> dict[str, Any]:
    """Everything the tier says about one cell, as the report's JSON fragment."""
    from overlap_spec.upstream.session import UpstreamCrash, is_drivable

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

    class ScriptedMachine(machine):  # type: ignore[valid-type, misc]
        def __init__(self) -> None:
            super().__init__()
            self.checker.script = self.script

    test = get_machine_test(ScriptedMachine, profile.max_examples, profile.step_count, seed,
                            True)
    violation: InvariantViolation | None = None
    crash: str | None = None
    failure_script: Path | None = None
    try:
        test()
    except InvariantViolation as error:
        violation = error
        script = log.last_script
        if script is not None:
            script.seed = seed
            failure_script = save_script(script, save_dir / f"{config.cell.name}-new.json")
    except UpstreamCrash as error:
        crash = str(error)
    except Exception as error:  # noqa: BLE001 - a crash of the tier is a failure
        crash = f"{type(error).__name__}: {str(error)[:400]}"
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
        # Each minimising trial drives sglang's scheduler again: the quick profile (a
        # reviewer's `review --sglang-src`) saves a listed finding as found, still
        # replayable; the others minimise it.
        if crash is None and profile.name != "quick":
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
    for inv in INVARIANTS:
        if not inv.applies(config.cell):
            invariants[inv.id] = "n/a"
        elif inv.id in UPSTREAM_NOT_APPLICABLE:
            invariants[inv.id] = "n/a"
        elif violation is not None and inv.id in violation.all_ids:
            invariants[inv.id] = "fail"
        elif any(f["invariant"] == inv.id and f["listed"] for f in findings):
            invariants[inv.id] = "finding"
        elif log.exercised[inv.id] == 0:
            invariants[inv.id] = "vacuous"
        else:
            invariants[inv.id] = "pass"
    if violation is not None and UPSTREAM_CHECKER_ID in violation.all_ids:
        invariants[UPSTREAM_CHECKER_ID] = "fail"
    else:
        witnessed = log.exercised[UPSTREAM_CHECKER_ID]
        invariants[UPSTREAM_CHECKER_ID] = "pass" if witnessed else "vacuous"

    started_diff = time.perf_counter()
    differential: dict[str, Any]
    if crash is not None:
        differential = {"verdict": "n/a", "reason": "the scheduler crashed in the check",
                        "divergences": []}
    else:
        diff = run_differential_cell(config, profile, seed, save_dir,
                                     max(profile.max_examples // 2, 10))
        verdict = "pass"
        if diff.divergence is not None or diff.error is not None:
            verdict = "fail"
        elif diff.operations == 0:
            verdict = "vacuous"
        differential = {
            "verdict": verdict, "examples": diff.examples, "operations_agreed": diff.operations,
            "explained": dict(diff.explained),
            "divergences": [] if diff.divergence is None else [diff.divergence],
            "error": diff.error,
        }
    vacuous = [i for i, v in invariants.items() if v == "vacuous"]
    failed = (violation is not None or crash is not None or bool(vacuous)
              or differential["verdict"] not in ("pass",))
    return {
        "verdict": "fail" if failed else "pass",
        "reason": crash or (f"vacuous: {', '.join(vacuous)}" if vacuous else None),
        "invariants": invariants,
        "exercised": dict(log.exercised),
        "runs": log.runs,
        "findings": findings,
        "differential": differential,
        "seconds": {"check": round(seconds_check, 1),
                    "differential": round(time.perf_counter() - started_diff, 1)},
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
    args = parser.parse_args(argv)
    from overlap_spec.upstream.bootstrap import UpstreamUnavailable, load_sglang

    try:
        source = load_sglang(args.sglang_src)
        sizes = parse_sizes(args.sizes) if args.sizes else {}
        config = ModelConfig(get_cell(args.cell), make_preset(args.preset, sizes))
        profile = get_profile(args.profile)
        args.out.mkdir(parents=True, exist_ok=True)
        result = run_cell(config, profile, args.seed, args.out)
    except (UpstreamUnavailable, KeyError, ValueError, argparse.ArgumentTypeError) as error:
        message = error.args[0] if error.args else str(error)
        print(f"overlap-spec upstream: {message}", file=sys.stderr)
        return 2
    result["sglang"] = {"version": source.version, "source": source.source}
    (args.out / f"{args.cell}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
