"""Witnesses by construction: every applicable invariant is exercised before the random
search starts, or reported n/a with its reason.

A random search that happens to draw no request capped to 0 new tokens leaves RP8 without
a witness, and the verdict of a clean tree then depends on the seed. So each cell's run
first replays deterministic witnesses, scripts that exercise a known set of invariants,
and only then searches at random:

- **The corpus** (``harness/drive/witnesses/<preset>/<sizes>.json``, committed): for each
  cell, the radix cells included, at the sizes the commands offer
  (:func:`get_corpus_sizes`: the presets' own, the default run's size variants, the
  serving chunk the upstream tier and the radix cells run with, and every size the
  README, ``--help`` or a catalogue bug names), a few minimised scripts with the
  invariants each *claims* to exercise, and for every applicable invariant no script
  reaches, the reason. ``overlap-spec witnesses --write`` regenerates it;
  ``overlap-spec witnesses`` (and ``tests/test_witness.py``) checks that every witness
  still exercises what it claims on the clean reference. A claimed invariant the run then
  leaves without a witness is *vacuous*: something that used to be exercised no longer
  is, a real failure.
- **The seeded search**, at sizes the corpus does not hold: :data:`SEARCH_SCRIPTS` random
  scripts of :data:`SEARCH_OPS` operations from fixed seeds (never the run's ``--seed``)
  in the form the release can be driven through, then as many of any form, each kept
  where it exercises something new. An invariant it does not reach is n/a at those
  sizes, with that reason, never vacuous and never a pass.

Where a witness runs is up to its caller: :func:`replay_witnesses` applies its operations
to a state machine of :mod:`overlap_spec.harness.drive.stateful` (the reference's, or the
upstream tier's, which drives the release), so a witness is checked by whatever checks
that machine. Only the corpus's upstream-drivable witnesses (no PD-prebuilt arrival, the
configured rung) run on the release.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from overlap_spec.harness.drive.cells import (
    SERVING_CHUNKED_PREFILL_SIZE,
    UsageError,
    check_sizes,
    format_sizes,
    get_size_variants,
    make_preset,
    split_preset,
)
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.generate import generate_random_ops
from overlap_spec.harness.drive.minimize import minimize_script
from overlap_spec.harness.drive.script import (
    Admit,
    AdmitPrebuilt,
    Iterate,
    Op,
    Script,
    op_from_json,
    op_to_json,
    run_script,
)
from overlap_spec.spec.config import Cell, ModelConfig, enumerate_cells, enumerate_radix_cells

CORPUS_DIR: Final = Path(__file__).resolve().parent / "witnesses"
CORPUS_VERSION: Final = 1
SEARCH_SCRIPTS: Final = 400
SEARCH_OPS: Final = 40
# The seeds of the search: fixed, so a cell's witnesses at given sizes never depend on the
# run's --seed (script k is drawn from random.Random(SEARCH_SEED + k)).
SEARCH_SEED: Final = 0x5EED_0000
MINIMIZE_BUDGET: Final = 150

# The sizes the corpus holds, per preset: the preset's own, every size the README or a
# command's --help offers as an example, and the catalogue's kill sizes (`--faults` sets
# them). tests/test_witness.py checks that every `--sizes` example in the README and the
# help texts is here.
DOCUMENTED_SIZES: Final[tuple[dict[str, int], ...]] = (
    {},
    {"kv_tokens": 16},
    {"kv_tokens": 12},
    {"kv_tokens": 16, "chain_steps": 2},
    {"max_running_requests": 2},
    {"chunked_prefill_size": 4},
    {"chunked_prefill_size": 4, "mixed_chunk": 1},
)


def get_corpus_cells() -> tuple[Cell, ...]:
    """The cells the corpus holds: every cell, then every radix cell (``check`` and
    ``review`` run both)."""
    return (*enumerate_cells(), *enumerate_radix_cells())


def get_corpus_sizes() -> dict[str, list[dict[str, int]]]:
    """preset -> the size sets the corpus holds for it: the documented ones, the default
    run's size variants, the serving chunk (the upstream tier's serving-default cells and
    the default run's radix cells run at it: ``cells.get_upstream_config``), and the
    catalogue's kill sizes on the minimal preset, where the mutant matrix runs them."""
    from overlap_spec.harness.catalogue import BUGS

    corpus: dict[str, list[dict[str, int]]] = {
        "minimal": list(DOCUMENTED_SIZES), "realistic": [{}]}
    for preset, size_sets in corpus.items():  # the default run's size variants
        serving = {"chunked_prefill_size": SERVING_CHUNKED_PREFILL_SIZE[preset]}
        for sizes in [*(variant.sizes for variant in get_size_variants(preset)), serving]:
            if sizes not in size_sets:
                size_sets.append(dict(sizes))
    for bug in BUGS:
        sizes = dict(bug.sizes)
        if sizes and sizes not in corpus["minimal"]:
            corpus["minimal"].append(sizes)
    return corpus


@dataclass(frozen=True)
class Witness:
    """A script's operations and the invariants it exercises on the clean reference."""

    ops: tuple[Op, ...]
    claims: tuple[str, ...]

    @property
    def upstream(self) -> bool:
        """Whether the upstream tier can drive it: no PD-prebuilt arrival, and the
        configured speculative shape (the release's controller picks its rung)."""
        return not any(isinstance(op, AdmitPrebuilt)
                       or (isinstance(op, Iterate) and op.choices.spec_steps)
                       for op in self.ops)


@dataclass
class WitnessPlan:
    """One cell's deterministic witnesses: what they claim, and why the rest is n/a."""

    witnesses: list[Witness]
    na: dict[str, str]  # applicable invariant -> why no witness exists at these sizes
    source: str  # where the witnesses come from, for the report
    # A witness search that hit a violation or crash on the clean reference: its script.
    failure: Script | None = None

    @property
    def claimed(self) -> frozenset[str]:
        return frozenset(i for w in self.witnesses for i in w.claims)


def get_corpus_path(config: ModelConfig) -> Path:
    base, sizes = split_preset(config.preset)
    return _corpus_file(base, sizes)


def _corpus_file(preset: str, sizes: dict[str, int]) -> Path:
    return CORPUS_DIR / preset / f"{format_sizes(sizes) or 'default'}.json"


def group_reasons(per_cell: dict[str, dict[str, str]]) -> list[tuple[str, str, list[str]]]:
    """(invariant, reason, its cells) for each invariant and reason, sorted: how every
    report prints what is n/a for want of a witness (cell -> invariant -> reason in)."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for cell, reasons in per_cell.items():
        for inv, reason in reasons.items():
            grouped.setdefault((inv, reason), []).append(cell)
    return [(inv, reason, cells) for (inv, reason), cells in sorted(grouped.items())]


def _applicable(config: ModelConfig) -> list[str]:
    return [inv.id for inv in InvariantChecker(config).applicable]


def _exercised(script: Script) -> tuple[set[str] | None, Script | None]:
    """The invariants ``script`` exercises on the clean reference, or (None, script) when
    it violates one or crashes (a clean tree's failure: the caller reports it)."""
    outcome = run_script(script, catch_crash=True)
    if outcome.violation is not None or outcome.crashed is not None:
        return None, script
    return {i for i, count in outcome.checker.exercised.items() if count}, None


def get_na_reason(config: ModelConfig, invariant_id: str, searched: int) -> str:
    """Why ``invariant_id`` has no witness in ``config``: a structural reason where one is
    known, else what the seeded search tried."""
    if config.cell.is_spec:
        need = 1 + min(config.get_decode_reserve(config.get_shape(steps))
                       for steps in range(config.preset.chain_steps + 1))
        if need > config.kv_tokens:
            return (f"no request decodes at these sizes: a one-token prompt's first spec "
                    f"decode asks for {need} tokens (the prompt and the reserve) of a "
                    f"{config.kv_tokens}-token pool, so the out-of-memory abort ends it first")
    reason = (f"no witness at these sizes: the seeded witness search on this tree "
              f"({searched} scripts of {SEARCH_OPS} operations) reached no observation that "
              "exercises it")
    base, sizes = split_preset(config.preset)
    if sizes:
        own = ModelConfig(config.cell, make_preset(base, {}))
        try:
            plan = load_plan(own) if check_sizes(own) is None else None
        except CorpusError:  # a cell the corpus does not hold yet (its first --write)
            plan = None
        if plan is not None and invariant_id in plan.claimed:
            reason += (f" (the corpus witnesses it at {base}'s own sizes: a change that lost "
                       "it fails there as vacuous)")
    return reason


def search_witnesses(config: ModelConfig, minimize: bool = False,
                     scripts: int = SEARCH_SCRIPTS) -> WitnessPlan:
    """Seeded random scripts on the clean reference, each kept where it exercises an
    invariant none before it did; upstream-drivable scripts first (their prebuilt arrivals
    made ordinary admissions, the rung the configured one), then any. ``minimize`` shrinks
    each kept script to what still exercises its claims (the corpus's generator)."""
    applicable = set(_applicable(config))
    covered: set[str] = set()
    kept: list[Witness] = []
    searched = 0
    for drivable in (True, False):
        for k in range(scripts):
            if covered >= applicable:
                break
            ops = generate_random_ops(config, random.Random(SEARCH_SEED + k), SEARCH_OPS)
            if drivable:
                ops = [_as_drivable(op) for op in ops]
            searched += 1
            script = Script.for_config(config, ops)
            exercised, failure = _exercised(script)
            if exercised is None:
                return WitnessPlan(kept, {}, "search", failure)
            new = (exercised & applicable) - covered
            if not new:
                continue
            if minimize:
                script = minimize_script(script, "", MINIMIZE_BUDGET,
                                         still_fails=_still_exercises(new))
                exercised = _exercised(script)[0] or set()
            claims = exercised & applicable
            kept.append(Witness(tuple(script.ops), tuple(sorted(claims))))
            covered |= claims
    na = {i: get_na_reason(config, i, searched) for i in sorted(applicable - covered)}
    return WitnessPlan(kept, na, f"seeded search ({searched} scripts)")


def _as_drivable(op: Op) -> Op:
    if isinstance(op, AdmitPrebuilt):
        return Admit(op.prompt_len, op.max_new_tokens)
    if isinstance(op, Iterate) and op.choices.spec_steps:
        return Iterate(replace(op.choices, spec_steps=0))
    return op


def _still_exercises(claims: set[str]) -> Any:
    def check(trial: Script) -> bool:
        exercised = _exercised(trial)[0]
        return exercised is not None and claims <= exercised
    return check


# -- the corpus -----------------------------------------------------------------------------
def _witness_to_json(witness: Witness) -> dict[str, Any]:
    return {"claims": list(witness.claims), "ops": [op_to_json(op) for op in witness.ops]}


def _witness_from_json(raw: dict[str, Any], where: str) -> Witness:
    try:
        ops = tuple(op_from_json(op, i) for i, op in enumerate(raw["ops"]))
        return Witness(ops, tuple(raw["claims"]))
    except (KeyError, TypeError, ValueError) as error:
        raise CorpusError(f"{where}: malformed witness ({error})") from None


class CorpusError(ValueError):
    """The committed corpus is missing, malformed or out of date (regenerate it with
    ``overlap-spec witnesses --write``)."""


def load_plan(config: ModelConfig) -> WitnessPlan | None:
    """The corpus's witnesses for ``config`` (None: the corpus does not hold its sizes)."""
    path = get_corpus_path(config)
    if not path.exists():
        return None
    try:
        document = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CorpusError(f"{path}: unreadable ({error})") from None
    if document.get("version") != CORPUS_VERSION:
        raise CorpusError(f"{path}: corpus version {document.get('version')!r}, expected "
                          f"{CORPUS_VERSION}; regenerate with 'overlap-spec witnesses --write'")
    entry = document.get("cells", {}).get(config.cell.name)
    if entry is None:
        raise CorpusError(f"{path}: no entry for cell {config.cell.name}; regenerate with "
                          "'overlap-spec witnesses --write'")
    where = f"{path.name} {config.cell.name}"
    witnesses = [_witness_from_json(w, where) for w in entry["witnesses"]]
    return WitnessPlan(witnesses, dict(entry["na"]),
                       f"corpus {path.relative_to(CORPUS_DIR)}")


def get_plan(config: ModelConfig) -> WitnessPlan:
    """The corpus's witnesses where it holds ``config``'s sizes, else the seeded search's."""
    return load_plan(config) or search_witnesses(config)


def describe_witnesses(configs: list[ModelConfig]) -> str:
    """What a run says before its search starts: where each cell's witnesses come from and,
    for the corpus's sizes, what is n/a there and why."""
    held = [c for c in configs if get_corpus_path(c).exists()]
    lines = []
    if held:
        reasons: dict[str, dict[str, str]] = {}
        for config in held:
            try:
                plan = load_plan(config)
            except CorpusError as error:  # found before any cell runs: one line, exit 2
                raise UsageError(f"the witness corpus is damaged: {error}") from None
            reasons[config.name] = {} if plan is None else plan.na
        grouped = group_reasons(reasons)
        lines.append(f"witnesses: the committed corpus in {len(held)} of {len(configs)} "
                     "cells, replayed before the search"
                     + ("" if grouped else "; every applicable invariant has one"))
        lines += [f"  n/a: {inv} in {len(cells)} cell{'s' * (len(cells) != 1)}: {reason}"
                  for inv, reason, cells in grouped]
    if len(held) < len(configs):
        lines.append(f"witnesses: a seeded search (up to {2 * SEARCH_SCRIPTS} scripts of "
                     f"{SEARCH_OPS} ops) in "
                     f"{len(configs) - len(held)} cell(s) whose sizes the corpus does not "
                     "hold, at each cell's start; what it does not reach is n/a, its reason "
                     "printed with the verdict")
    return "\n".join(lines)


def _corpus_header(preset: str, sizes: dict[str, int]) -> dict[str, Any]:
    return {"version": CORPUS_VERSION, "preset": preset, "sizes": dict(sorted(sizes.items())),
            "generated_by": "overlap-spec witnesses --write",
            "search": {"scripts": SEARCH_SCRIPTS, "ops": SEARCH_OPS, "seed": SEARCH_SEED}}


def generate_cell(config: ModelConfig) -> dict[str, Any]:
    """One cell's corpus entry: minimised witnesses and the n/a reasons (a pool task); what
    the search left n/a and a committed witness still exercises keeps that witness."""
    plan = search_witnesses(config, minimize=True)
    if plan.failure is not None:
        raise CorpusError(f"{config.name}: the clean reference fails a witness script "
                          f"({len(plan.failure.ops)} ops); fix the tree first")
    carried = carry_over(config, set(plan.na))
    na = {i: reason for i, reason in plan.na.items()
          if not any(i in w.claims for w in carried)}
    return {"witnesses": [_witness_to_json(w) for w in [*plan.witnesses, *carried]],
            "na": na}


def carry_over(config: ModelConfig, missing: set[str]) -> list[Witness]:
    """The committed corpus's witnesses of what the search no longer reached (``missing``)
    that still exercise it on today's clean reference, each claiming only that: a search
    whose draws moved (a new operation, a new literal Hypothesis mines) must not lose a
    witness that still works. A damaged or absent corpus file carries nothing over."""
    try:
        old = load_plan(config) if missing else None
    except CorpusError:
        old = None
    kept: list[Witness] = []
    for witness in [] if old is None else old.witnesses:
        wanted = missing & set(witness.claims)
        exercised = _exercised(Script.for_config(config, list(witness.ops)))[0] \
            if wanted else None
        still = wanted & (exercised or set())
        if still:
            kept.append(Witness(witness.ops, tuple(sorted(still))))
            missing -= still
    return kept


def check_cell_corpus(config: ModelConfig) -> list[str]:
    """What is wrong with one cell's corpus entry today (a pool task)."""
    try:
        plan = load_plan(config)
    except CorpusError as error:
        return [str(error)]
    if plan is None:
        return [f"{get_corpus_path(config)}: missing; regenerate with "
                "'overlap-spec witnesses --write'"]
    return check_plan(config, plan)


def check_plan(config: ModelConfig, plan: WitnessPlan) -> list[str]:
    """What is wrong with a corpus entry on today's clean reference: a witness that fails
    or no longer exercises a claim, an applicable invariant neither claimed nor given a
    reason, a claim or reason for one that does not apply."""
    problems: list[str] = []
    applicable = set(_applicable(config))
    for index, witness in enumerate(plan.witnesses):
        script = Script.for_config(config, list(witness.ops))
        outcome = run_script(script, catch_crash=True)
        if outcome.violation is not None or outcome.crashed is not None:
            problems.append(f"{config.name} witness {index}: fails on the clean reference: "
                            f"{outcome.violation or outcome.crash}")
            continue
        lost = sorted(i for i in witness.claims if not outcome.checker.exercised.get(i))
        if lost:
            problems.append(f"{config.name} witness {index}: no longer exercises "
                            f"{', '.join(lost)}")
    claimed = plan.claimed
    for inv in sorted(applicable - claimed - set(plan.na)):
        problems.append(f"{config.name}: {inv} applies but is neither claimed nor n/a")
    for inv in sorted((claimed | set(plan.na)) - applicable):
        problems.append(f"{config.name}: {inv} is in the corpus but does not apply")
    for inv in sorted(claimed & set(plan.na)):
        problems.append(f"{config.name}: {inv} is both claimed and n/a")
    return problems


def iter_corpus_configs() -> list[tuple[str, dict[str, int], list[ModelConfig]]]:
    """(preset, sizes, the cells that take those sizes) for every size set of the corpus."""
    found = []
    for preset, size_sets in get_corpus_sizes().items():
        for sizes in size_sets:
            configs = [ModelConfig(cell, make_preset(preset, sizes))
                       for cell in get_corpus_cells()]
            found.append((preset, sizes, [c for c in configs if check_sizes(c) is None]))
    return found


def get_stale_files() -> list[Path]:
    """Corpus files for sizes the corpus no longer holds."""
    wanted = {get_corpus_path(configs[0]) for _, _, configs in iter_corpus_configs()}
    return sorted(p for p in CORPUS_DIR.rglob("*.json") if p not in wanted)


def get_lost_claims(configs: list[ModelConfig], entries: dict[str, dict[str, Any]]
                    ) -> list[str]:
    """What a regenerated corpus would turn from claimed into n/a, a line per cell."""
    lines = []
    for config in configs:
        try:
            old = load_plan(config)
        except CorpusError:
            continue  # a damaged file is replaced whole
        moved = sorted(set() if old is None else old.claimed & set(entries[config.name]["na"]))
        if moved:
            lines.append(f"{config.name}: {', '.join(moved)} witnessed before, n/a now "
                         f"({entries[config.name]['na'][moved[0]]})")
    return lines


def write_corpus_file(preset: str, sizes: dict[str, int],
                      entries: dict[str, dict[str, Any]]) -> Path:
    """One size set's file: a witness a line, so a regenerated corpus diffs by witness."""
    document = {**_corpus_header(preset, sizes), "cells": entries}
    path = _corpus_file(preset, sizes)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(document, separators=(",", ":"))
    path.write_text(text.replace('{"claims"', '\n{"claims"') + "\n")
    return path


def replay_witnesses(machine: Any, plan: WitnessPlan, upstream: bool = False,
                     ignore: frozenset[str] = frozenset(),
                     excused: Callable[[Any], set[str] | None] | None = None,
                     ) -> tuple[int, dict[int, list[str]]]:
    """Apply each witness's operations to a fresh instance of ``machine`` (a state machine
    class of :func:`overlap_spec.harness.drive.stateful.make_machine`) and tear it down,
    as Hypothesis runs one example; an invariant violation or crash propagates, as in a
    Hypothesis run. ``upstream``: only the witnesses the release can be driven through.
    Returns how many ran, and for each witness that no longer exercised every claim (but
    those in ``ignore``, and those ``excused(checker)`` names for that run: the upstream
    tier's listed findings, which judge the release's state otherwise; None excuses all),
    the claims it lost: the search may still reach them, so a lost claim is reported, and
    is vacuous only if nothing else reaches it."""
    ran = 0
    lost: dict[int, list[str]] = {}
    for index, witness in enumerate(plan.witnesses):
        if upstream and not witness.upstream:
            continue
        instance = machine()
        for op in witness.ops:
            instance._apply(op)
        spared = set() if excused is None else excused(instance.checker)
        missed = [] if spared is None else [
            i for i in witness.claims if i not in ignore and i not in spared
            and not instance.checker.exercised.get(i)]
        instance.teardown()
        ran += 1
        if missed:
            lost[index] = missed
    return ran, lost

# -- overlap-spec witnesses ---------------------------------------------------------------
def cmd_witnesses(args: Any) -> int:
    """``overlap-spec witnesses [--write] [--jobs N]``: check the committed corpus on
    today's clean reference (exit 1 on a witness that fails or lost a claim, a cell or
    size set missing, a stale file), or regenerate it."""
    from overlap_spec.harness.pool import run_tasks

    size_sets = iter_corpus_configs()
    tasks = [config for _, _, configs in size_sets for config in configs]
    if args.write:
        print(f"witnesses: regenerating the corpus, {len(size_sets)} size sets, "
              f"{len(tasks)} cells (a seeded search of up to {SEARCH_SCRIPTS} scripts each, "
              "minimised)", flush=True)
        entries = run_tasks(generate_cell, tasks, args.jobs)
        by_config = dict(zip([c.name for c in tasks], entries, strict=True))
        lost = get_lost_claims(tasks, by_config)
        if lost and not args.accept_lost:
            for line in lost:
                print(line)
            print(f"FAILED: {len(lost)} invariant x cell pairs the corpus witnessed would be "
                  "n/a: nothing written. A change that lost them is what vacuity reports; "
                  "if the loss is intended, rerun with --accept-lost")
            return 1
        for preset, sizes, configs in size_sets:
            path = write_corpus_file(preset, sizes,
                                     {c.cell.name: by_config[c.name] for c in configs})
            na = sum(len(by_config[c.name]["na"]) for c in configs)
            print(f"  {path.relative_to(CORPUS_DIR)}: {len(configs)} cells"
                  + (f", {na} invariant x cell n/a" if na else ""))
        for stale in get_stale_files():
            stale.unlink()
            print(f"  removed {stale.relative_to(CORPUS_DIR)} (sizes no longer held)")
        return 0
    problems = [p for found in run_tasks(check_cell_corpus, tasks, args.jobs) for p in found]
    problems += [f"{p}: stale (its sizes are not in the corpus's list); regenerate with "
                 "'overlap-spec witnesses --write'" for p in get_stale_files()]
    for problem in problems:
        print(problem)
    witnesses = 0
    for _, _, configs in size_sets:
        for config in configs:
            plan = load_plan(config)
            witnesses += 0 if plan is None else len(plan.witnesses)
    print(f"{'FAILED' if problems else 'OK'}: {len(tasks)} cells in {len(size_sets)} size "
          f"sets, {witnesses} witnesses" + (f", {len(problems)} problems" if problems else
                                            ", each still exercising what it claims"))
    return 1 if problems else 0
