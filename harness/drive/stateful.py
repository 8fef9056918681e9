"""Hypothesis stateful checking: random operation sequences, invariants after every step.

The machine's rules are the script operations (admit, iterate, abort, and flush in the
radix cells); the observer checks every applicable invariant at every observation point
inside each operation. A failure is shrunk by Hypothesis, saved as a replayable
script (:mod:`overlap_spec.harness.drive.script`) and reported with the seed.

Profiles (``HYPOTHESIS_PROFILE`` or ``--profile``): ``quick`` (``overlap-spec review``),
``ci`` (default), ``dev``, ``thorough``.
"""

from __future__ import annotations

import os
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    precondition,
    rule,
)

from overlap_spec.harness.drive.cells import UsageError, get_share_examples
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.generate import get_strategies
from overlap_spec.harness.drive.minimize import minimize_script
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
    get_factory,
    run_script,
    save_script,
)
from overlap_spec.harness.drive.witness import Witness, WitnessPlan, get_plan, replay_witnesses
from overlap_spec.harness.trace.check import TraceVerdict, get_claim, record_script_trace
from overlap_spec.harness.trace.format import get_trace_path
from overlap_spec.harness.trace.plot import is_plottable
from overlap_spec.spec.config import ModelConfig
from overlap_spec.spec.invariants import INVARIANTS_BY_ID, InvariantViolation
from overlap_spec.spec.state import IterationChoices
from overlap_spec.spec.units import RequestId


@dataclass(frozen=True)
class Profile:
    name: str
    max_examples: int
    step_count: int
    mutant_examples: int  # per mutant and cell; a kill usually stops far earlier


PROFILES = {
    # quick: `overlap-spec review`, a reviewer's minute; still a witness for every
    # applicable invariant in every cell at the default seed (tests/test_review.py).
    "quick": Profile("quick", max_examples=50, step_count=30, mutant_examples=1000),
    # ci: `check` and the test tier; with the size variants a cell's examples are shared
    # (cells.get_budget_shares), and `check` stays within five minutes on 2 cores.
    "ci": Profile("ci", max_examples=64, step_count=40, mutant_examples=1000),
    "dev": Profile("dev", max_examples=1000, step_count=60, mutant_examples=2000),
    "thorough": Profile("thorough", max_examples=5000, step_count=100, mutant_examples=10000),
}

MAX_REQUESTS = 6


def get_profile(name: str | None = None) -> Profile:
    chosen = name or os.environ.get("HYPOTHESIS_PROFILE", "ci")
    if chosen not in PROFILES:
        where = "" if name else " (from HYPOTHESIS_PROFILE)"
        raise UsageError(f"unknown profile {chosen!r}{where}; choose one of "
                         f"{', '.join(PROFILES)}")
    return PROFILES[chosen]


def get_failure_dir() -> Path:
    return Path(os.environ.get("OVERLAP_SPEC_OUT", ".overlap-spec")) / "failures"


@dataclass
class RunLog:
    """What a machine's runs leave for the caller: witness counts per invariant, the number
    of runs and observations, and the script of the run in progress (after a failing test,
    the failing run's: Hypothesis replays the shrunk example last)."""

    exercised: Counter[str] = field(default_factory=Counter)
    runs: int = 0
    observations: int = 0
    last_script: Script | None = None
    # operations per mechanism (harness.drive.mechanisms), summed over the runs
    mechanisms: Counter[str] = field(default_factory=Counter)


def make_machine(config: ModelConfig, faults: frozenset[str], implementation: str = "reference",
                 log: RunLog | None = None,
                 checker_factory: Callable[[ModelConfig], InvariantChecker] = InvariantChecker,
                 ) -> type[RuleBasedStateMachine]:
    """A state machine class bound to one configuration and fault set.

    The upstream tier (``implementation="upstream"``) drives what sglang 0.5.23 can be
    driven through: no PD prebuilt admissions, and the configured speculative shape (the
    release's reserve does not depend on the adaptive rung, which its controller picks).
    No implementation draws PD prebuilt admissions with chunked prefill (below).
    """
    upstream = implementation == "upstream"
    # PD-prebuilt arrivals are drawn without chunked prefill only: a PD decode instance
    # does not prefill, and with chunking the two together can continue a chunk into a
    # pool the budget did not hold for it, a state the release has no path to.
    chunked = bool(config.preset.chunked_prefill_size)
    draw = get_strategies(config, upstream)
    factory = get_factory(implementation)

    class SchedulerMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.checker = checker_factory(config)
            self.model = factory(config, faults, self.checker)
            self.script = Script.for_config(config, [], tuple(sorted(faults)), implementation)
            self.admitted: list[RequestId] = []
            self.paused = False
            self.pauses = 0
            if log is not None:
                log.last_script = self.script

        def _apply(self, op: Op) -> None:
            self.script.ops.append(op)
            self.model.set_step_index(len(self.script.ops) - 1)
            apply_op(self.model, op, self.admitted)

        if config.cell.radix:  # prompts of a few families, so prefixes are shared
            @precondition(lambda self: len(self.admitted) < MAX_REQUESTS)
            @rule(prompt_len=draw.prompt_len, max_new_tokens=draw.max_new_tokens,
                  family=draw.family)
            def admit(self, prompt_len: int, max_new_tokens: int, family: int | None) -> None:
                self._apply(Admit(prompt_len, max_new_tokens, family))
        else:  # the rule as it was, so a seed draws what it drew before radix cells
            @precondition(lambda self: len(self.admitted) < MAX_REQUESTS)
            @rule(prompt_len=draw.prompt_len, max_new_tokens=draw.max_new_tokens)
            def admit(self, prompt_len: int, max_new_tokens: int) -> None:
                self._apply(Admit(prompt_len, max_new_tokens))

        @precondition(lambda self: not (upstream or chunked)
                      and len(self.admitted) < MAX_REQUESTS)
        @rule(prompt_len=draw.prompt_len, max_new_tokens=draw.prebuilt_max_new_tokens)
        def admit_prebuilt(self, prompt_len: int, max_new_tokens: int) -> None:
            self._apply(AdmitPrebuilt(prompt_len, max_new_tokens))

        @rule(allow_prefill=st.booleans(),
              retract=st.integers(0, 1),
              accept_lens=draw.accept_lens,
              eos_positions=draw.eos_positions,
              disable_overlap=draw.rarely,
              spec_steps=draw.spec_steps,
              eos_offset=draw.eos_offset)
        def iterate(self, allow_prefill: bool, retract: int, accept_lens: list[int],
                    eos_positions: frozenset[int], disable_overlap: bool,
                    spec_steps: int, eos_offset: int) -> None:
            self._apply(Iterate(IterationChoices(allow_prefill, retract, tuple(accept_lens),
                                                 eos_positions, disable_overlap, spec_steps,
                                                 eos_offset)))

        @precondition(lambda self: bool(self.admitted))
        @rule(request=st.integers(0, MAX_REQUESTS - 1))
        def abort(self, request: int) -> None:
            self._apply(Abort(request))

        if config.cell.radix:  # elsewhere the rules as they were, so a seed draws the same
            @rule()
            def flush(self) -> None:
                self._apply(Flush())

        # pause_generation(mode="retract"), at most once a run (it retracts everything, which
        # would starve the states other bugs need), resumed at once or by a later rule:
        # everything unfinished back to the waiting queue, iterations building nothing
        # meanwhile.
        # Not in the upstream tier's search: the release loses an abort of the chunked
        # request that a pause retracts before the next step's top (its marker is dropped,
        # no to_finish set), where the reference finishes it "abort" (found 2026-11-29;
        # docs/upstream-pause-retract.md). Until that is modelled or listed, the release is
        # paused by its witnesses and tests/test_upstream_tier.py only.
        @precondition(lambda self: not upstream and not self.paused and not self.pauses)
        @rule(resume=st.booleans())
        def pause_retract(self, resume: bool) -> None:
            self._apply(PauseRetract())
            if resume:
                self._apply(Continue())
            self.paused = not resume
            self.pauses += 1

        @precondition(lambda self: self.paused)
        @rule()
        def continue_generation(self) -> None:
            self._apply(Continue())
            self.paused = False

        def teardown(self) -> None:
            if log is not None:
                log.exercised.update(self.checker.exercised)
                if self.checker.mechanisms is not None:
                    log.mechanisms.update(self.checker.mechanisms.get_counts())
                log.runs += 1
                log.observations += self.checker.observations

    SchedulerMachine.__name__ = f"SchedulerMachine[{config.name}]"
    return SchedulerMachine


@dataclass
class CellResult:
    config: ModelConfig
    faults: frozenset[str]
    seed: int
    profile: str
    seconds: float
    violation: InvariantViolation | None = None
    script: Script | None = None
    script_path: Path | None = None
    exercised: Counter[str] = field(default_factory=Counter)
    runs: int = 0
    observations: int = 0
    # operations per mechanism the run's observations showed (harness.drive.mechanisms)
    mechanisms: Counter[str] = field(default_factory=Counter)
    error: BaseException | None = None
    # The trace checker's verdict on the saved counterexample's trace (None: nothing saved).
    trace_verdict: TraceVerdict | None = None
    # The deterministic witnesses replayed before the search (harness.drive.witness): where
    # they came from, how many ran, and the applicable invariants that have none at these
    # sizes with the reason (n/a, not vacuous). None: the run replayed no witnesses.
    witness_source: str | None = None
    witnesses_ran: int = 0
    witnesses_lost: dict[int, list[str]] = field(default_factory=dict)  # witness -> claims
    na_reasons: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.violation is None and self.error is None

    @property
    def failed_ids(self) -> tuple[str, ...]:
        return self.violation.all_ids if self.violation is not None else ()


# Packages whose literals Hypothesis may draw as constants (below): what every stateful
# run imports, whatever else the process has loaded.
CONSTANT_PACKAGES = ("overlap_spec.spec", "overlap_spec.reference", "overlap_spec.harness.drive")
_pinned_constants: Any = None


def pin_local_constants() -> None:
    """Make a seed's search depend on the seed and the code, not on the process.

    Hypothesis 6.170 also draws, now and then, literals of the project's own modules that
    happen to be loaded (``providers._get_local_constants`` scans ``sys.modules``), so the
    same seed searched otherwise in a process that had imported the differential, or a
    worker that had run a gpu_impl task before. Its draws come from the modules of
    :data:`CONSTANT_PACKAGES` instead, all of them, every time."""
    global _pinned_constants
    from hypothesis.internal.conjecture import providers
    from hypothesis.internal.constants_ast import Constants, constants_from_module

    if _pinned_constants is None:
        import importlib
        import pkgutil

        constants = Constants()
        for name in CONSTANT_PACKAGES:
            package = importlib.import_module(name)
            # Subpackages too (spec/invariants/: a module per family).
            modules = [package] + [importlib.import_module(info.name) for info in
                                   pkgutil.walk_packages(package.__path__, f"{name}.")]
            for module in modules:
                constants |= constants_from_module(module)
        _pinned_constants = constants
    if providers._get_local_constants is not _get_pinned_constants:
        providers._get_local_constants = _get_pinned_constants
        providers.CONSTANTS_CACHE.cache.clear()


def _get_pinned_constants() -> Any:
    return _pinned_constants


def get_machine_test(machine: type[RuleBasedStateMachine], max_examples: int, step_count: int,
                     run_seed: int, shrink: bool) -> Any:
    """The seeded Hypothesis test of ``machine`` (no database: a seed replays the search,
    Hypothesis's constants pinned: :func:`pin_local_constants`)."""
    pin_local_constants()
    test: Any = get_state_machine_test(
        machine,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=step_count,
            deadline=None,
            database=None,
            phases=(Phase.generate, Phase.shrink) if shrink else (Phase.generate,),
            suppress_health_check=list(HealthCheck),
            print_blob=False,
            report_multiple_bugs=False,
        ),
    )
    return seed(run_seed)(test)


def check_cell(config: ModelConfig, profile: Profile, run_seed: int,
               faults: frozenset[str] = frozenset(), implementation: str = "reference",
               save_dir: Path | None = None, shrink: bool = True,
               max_examples: int | None = None, minimize: bool = False,
               witnesses: bool = False) -> CellResult:
    """Run the stateful check in one cell; never raises for a violation, returns it.

    ``shrink=False`` skips Hypothesis's shrinker; ``minimize`` then shrinks the failing
    script with :func:`~overlap_spec.harness.drive.minimize.minimize_script` (same first
    invariant), which is much cheaper for these short operation scripts (the mutant
    runner minimises for the catalogue's invariant itself). ``max_examples`` overrides
    the profile's (the mutant runner's budget). ``witnesses``: replay the cell's
    deterministic witnesses (:func:`~overlap_spec.harness.drive.witness.get_plan`) before
    the search, so that every applicable invariant is exercised by construction or
    reported n/a with its reason (``check`` and ``review``; the mutant matrix, which asks
    for a kill and not a witness, leaves them out).
    """
    plan = get_plan(config) if witnesses else None
    log = RunLog()
    machine = make_machine(config, faults, implementation, log)
    examples = max_examples or profile.max_examples
    test = get_machine_test(machine, examples, profile.step_count, run_seed, shrink)
    started = time.perf_counter()
    result = CellResult(config, faults, run_seed, profile.name, 0.0)
    if plan is not None:
        result.witness_source, result.na_reasons = plan.source, dict(plan.na)
    in_witnesses = plan is not None
    try:
        if plan is not None:
            if plan.failure is not None:  # the seeded search failed on the clean reference
                replay_witnesses(machine, WitnessPlan([Witness(tuple(plan.failure.ops), ())],
                                                      {}, plan.source))
            result.witnesses_ran, result.witnesses_lost = replay_witnesses(machine, plan)
        in_witnesses = False
        test()
    except InvariantViolation as violation:
        result.violation = violation
        script = log.last_script
        # A witness that trips an invariant is minimised like a review's find (Hypothesis
        # never saw it, so its shrinker did not run).
        if script is not None and ((minimize and not shrink) or in_witnesses):
            script = minimize_script(script, violation.invariant_id)
            # The report describes the script that is saved.
            result.violation = run_script(script).violation or violation
        if script is not None:
            script.set_search_seed(run_seed)
            result.script = script
            name = "-".join([config.name.replace("@", "-"), *sorted(faults)])
            directory = save_dir or get_failure_dir()
            result.script_path = save_script(script, directory / f"{name}.json")
            # The same counterexample as a trace (harness/trace.py), checkable on its own.
            result.trace_verdict = record_script_trace(script,
                                                       get_trace_path(result.script_path))
    except Exception as error:  # a crash of the implementation is a failure, not a pass
        result.error = error
        script = log.last_script
        if script is not None:  # the crash, like a violation, is saved and replayable
            script.set_search_seed(run_seed)
            result.script = script
            name = "-".join([config.name.replace("@", "-"), *sorted(faults), "crash"])
            directory = save_dir or get_failure_dir()
            result.script_path = save_script(script, directory / f"{name}.json")
    result.seconds = time.perf_counter() - started
    result.exercised = log.exercised
    result.mechanisms = log.mechanisms
    result.runs = log.runs
    result.observations = log.observations
    return result


@dataclass(frozen=True)
class CellTask:
    """One cell of the Hypothesis tier, as sent to a worker process (defined here, not in
    harness/check.py, so that a spawned worker imports no torch: about 2 s of CPU each)."""

    config: ModelConfig
    profile: Profile
    seed: int
    faults: frozenset[str]
    save_dir: Path | None
    # False: no Hypothesis shrinking; the failing script is minimised instead (review).
    shrink: bool = True
    # The configuration's share of the profile's sequences (cells.get_budget_shares).
    share: float = 1.0


def run_cell_task(task: CellTask) -> CellResult:
    return check_cell(task.config, task.profile, task.seed, task.faults, save_dir=task.save_dir,
                      shrink=task.shrink, minimize=not task.shrink, witnesses=True,
                      max_examples=get_share_examples(task.profile.max_examples, task.share))


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' * (number != 1)}"


# The width of a failure block's wrapped lines (report.render_failures indents it by 4).
CLAIM_WIDTH = 96


def describe_claim(invariant_id: str) -> list[str]:
    """``claim: ID (its one-line claim): the claim in full (its source)``, as the registry
    (spec/invariants/) holds them, wrapped."""
    inv = INVARIANTS_BY_ID.get(invariant_id)
    if inv is None:
        return []
    return textwrap.wrap(f"claim: {inv.id} ({inv.claim}): {get_claim(inv.id)}", CLAIM_WIDTH,
                         subsequent_indent="  ", break_on_hyphens=False)


def describe_picture(trace: Path, verdict: TraceVerdict) -> str:
    """The command that draws ``trace``'s picture beside it: the length plot of an
    arithmetic violation (with the bound broken), else the timeline (a race's pair linked)."""
    if is_plottable(verdict):
        return f"picture (lengths and bound): overlap-spec trace plot {trace}"
    return f"picture (timeline): overlap-spec trace render {trace}"


def describe_failure(result: CellResult) -> str:
    """The lines a user needs: which ID, where, the seed and the replay command; then the
    invariant's claim and the command that draws the saved trace's picture."""
    lines = [f"cell {result.config.name}, seed {result.seed}, profile {result.profile}"]
    if result.violation is not None:
        lines.append(str(result.violation))
        if result.script is not None:
            lines.append(f"counterexample: {_count(len(result.script.ops), 'op')}, "
                         f"{_count(result.script.count_requests(), 'request')}")
        if result.script_path is not None:
            lines.append(f"replay: overlap-spec replay {result.script_path}")
        verdict = result.trace_verdict
        trace = (get_trace_path(result.script_path or Path("."))
                 if verdict is not None else None)
        if verdict is not None:
            lines.append(f"trace: {trace} (trace checker: {verdict.status})")
        lines += describe_claim(result.violation.invariant_id)
        if verdict is not None and trace is not None:
            lines.append(describe_picture(trace, verdict))
    if result.error is not None:
        lines.append(f"implementation crashed: {type(result.error).__name__}: {result.error}")
        if result.script is not None:
            lines.append(f"crashing run: {_count(len(result.script.ops), 'op')}, "
                         f"{_count(result.script.count_requests(), 'request')}")
        if result.script_path is not None:
            lines.append(f"replay: overlap-spec replay {result.script_path}")
    return "\n".join(lines)
