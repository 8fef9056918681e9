"""Operation scripts: the replayable form of every run and every counterexample.

A script is JSON::

    {"version": 1, "cell": "ov-p1-v2chain-cpu-honest", "preset": "minimal",
     "faults": ["B3"], "seed": 12345, "hypothesis_version": "6.170.15",
     "implementation": "reference",
     "ops": [{"op": "admit", "prompt_len": 3, "max_new_tokens": 4},
             {"op": "iterate", "allow_prefill": true, "retract": 0,
              "accept_lens": [2, 1, 1], "eos_positions": [0]},
             {"op": "abort", "request": 0},
             {"op": "flush"}, {"op": "pause_retract"}, {"op": "continue"}]}

An optional ``"sizes"`` object sets sizes in place of the preset's (the KV pool,
the request rows, the chain's draft steps; ``harness.drive.cells.SIZE_LIMITS`` holds
their ranges): ``"sizes": {"kv_tokens": 16, "chain_steps": 2}``. ``"hypothesis_version"``,
optional, is the Hypothesis that searched with ``seed``: the seed replays the same search
only under that version (a script without it loads as before).

``overlap-spec replay FILE`` runs it and reports the first violation. Loading checks every
field's type and every number against the cell's and preset's limits (the ranges the
checkers draw from, :func:`get_op_limits`): a negative or huge length would otherwise run
and report nothing, or the wrong thing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis

from overlap_spec.harness.crash import Crash
from overlap_spec.harness.drive.cells import UsageError, check_sizes, make_preset, split_preset
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.reference.scheduler import SUPPORTED_FAULTS, Scheduler
from overlap_spec.spec.config import PRESETS, ModelConfig, get_cell
from overlap_spec.spec.interface import Observer, SchedulerModel
from overlap_spec.spec.invariants import InvariantViolation
from overlap_spec.spec.state import IterationChoices
from overlap_spec.spec.units import RequestId

SCRIPT_VERSION = 1


class ScriptError(ValueError):
    """A script file that cannot be read: says which field and why."""


@dataclass(frozen=True)
class Admit:
    prompt_len: int
    max_new_tokens: int
    # The prompt's token family (spec.state.compute_prompt_token); None: the request's own
    # id. Requests of one family share their prompts' common prefix (radix cells share it).
    family: int | None = None


@dataclass(frozen=True)
class AdmitPrebuilt:
    prompt_len: int
    max_new_tokens: int


@dataclass(frozen=True)
class Iterate:
    choices: IterationChoices


@dataclass(frozen=True)
class Abort:
    request: int  # index into the admitted requests, in admission order


@dataclass(frozen=True)
class Flush:
    """``flush_cache`` between iterations: it runs when the scheduler is fully idle and is
    refused (nothing changes) otherwise."""


@dataclass(frozen=True)
class PauseRetract:
    """``pause_generation(mode="retract")`` between iterations: every unfinished request
    running, just prefilled or chunked is retracted and re-queued, and iterations build
    nothing until :class:`Continue`."""


@dataclass(frozen=True)
class Continue:
    """``continue_generation``: iterations build batches again (nothing if not paused)."""


Op = Admit | AdmitPrebuilt | Iterate | Abort | Flush | PauseRetract | Continue


@dataclass
class Script:
    cell: str
    preset: str
    ops: list[Op] = field(default_factory=list)
    faults: tuple[str, ...] = ()
    seed: int | None = None
    implementation: str = "reference"
    sizes: dict[str, int] = field(default_factory=dict)  # in place of the preset's
    hypothesis_version: str | None = None  # the Hypothesis that searched with ``seed``

    @classmethod
    def for_config(cls, config: ModelConfig, ops: list[Op] | None = None,
                   faults: tuple[str, ...] = (), implementation: str = "reference") -> Script:
        """A script of ``config``: its cell, its preset's name and any sizes it sets."""
        base, sizes = split_preset(config.preset)
        return cls(config.cell.name, base, list(ops or []), faults,
                   implementation=implementation, sizes=sizes)

    def get_config(self) -> ModelConfig:
        return ModelConfig(get_cell(self.cell), make_preset(self.preset, self.sizes))

    def set_search_seed(self, seed: int) -> None:
        """Record the seed the search that found this script ran with, and the Hypothesis
        version that ran it: the seed replays the same search only under that version."""
        self.seed = seed
        self.hypothesis_version = hypothesis.__version__

    def count_requests(self) -> int:
        return sum(1 for op in self.ops if isinstance(op, Admit | AdmitPrebuilt))


def op_to_json(op: Op) -> dict[str, Any]:
    if isinstance(op, Admit):
        family = {} if op.family is None else {"family": op.family}
        return {"op": "admit", "prompt_len": op.prompt_len, "max_new_tokens": op.max_new_tokens,
                **family}
    if isinstance(op, AdmitPrebuilt):
        return {"op": "admit_prebuilt", "prompt_len": op.prompt_len,
                "max_new_tokens": op.max_new_tokens}
    if isinstance(op, Abort):
        return {"op": "abort", "request": op.request}
    if isinstance(op, Flush):
        return {"op": "flush"}
    if isinstance(op, PauseRetract):
        return {"op": "pause_retract"}
    if isinstance(op, Continue):
        return {"op": "continue"}
    c = op.choices
    return {"op": "iterate", "allow_prefill": c.allow_prefill, "retract": c.retract,
            "accept_lens": list(c.accept_lens), "eos_positions": sorted(c.eos_positions),
            "disable_overlap": c.disable_overlap, "spec_steps": c.spec_steps,
            "eos_offset": c.eos_offset}


def _field(raw: dict[str, Any], name: str, kind: type, where: str) -> Any:
    if name not in raw:
        raise ScriptError(f"{where}: missing field {name!r}")
    value = raw[name]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ScriptError(f"{where}: field {name!r} must be an integer, got {value!r}")
    if kind is not int and not isinstance(value, kind):
        raise ScriptError(f"{where}: field {name!r} must be {kind.__name__}, got {value!r}")
    return value


def op_from_json(raw: Any, index: int) -> Op:
    where = f"op {index}"
    if not isinstance(raw, dict):
        raise ScriptError(f"{where}: expected an object")
    kind = raw.get("op")
    if kind == "admit":
        family = _field(raw, "family", int, where) if "family" in raw else None
        if family is not None and family < 0:
            raise ScriptError(f"{where}: field 'family' must be >= 0, got {family}")
        return Admit(_field(raw, "prompt_len", int, where),
                     _field(raw, "max_new_tokens", int, where), family)
    if kind == "admit_prebuilt":
        return AdmitPrebuilt(_field(raw, "prompt_len", int, where),
                             _field(raw, "max_new_tokens", int, where))
    if kind == "abort":
        return Abort(_field(raw, "request", int, where))
    if kind == "flush":
        return Flush()
    if kind == "pause_retract":
        return PauseRetract()
    if kind == "continue":
        return Continue()
    if kind == "iterate":
        accept = _field(raw, "accept_lens", list, where)
        eos = _field(raw, "eos_positions", list, where)
        for name, values in (("accept_lens", accept), ("eos_positions", eos)):
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise ScriptError(f"{where}: field {name!r} must be a list of integers")
        return Iterate(IterationChoices(
            allow_prefill=_field(raw, "allow_prefill", bool, where),
            retract=_field(raw, "retract", int, where),
            accept_lens=tuple(int(a) for a in accept),
            eos_positions=frozenset(int(e) for e in eos),
            disable_overlap=_field(raw, "disable_overlap", bool, where)
            if "disable_overlap" in raw else False,
            spec_steps=_field(raw, "spec_steps", int, where) if "spec_steps" in raw else 0,
            eos_offset=_field(raw, "eos_offset", int, where) if "eos_offset" in raw else 0,
        ))
    raise ScriptError(f"{where}: unknown op {kind!r} "
                      "(expected admit, admit_prebuilt, iterate, abort, flush, "
                      "pause_retract or continue)")


def script_to_json(script: Script) -> dict[str, Any]:
    return {"version": SCRIPT_VERSION, "cell": script.cell, "preset": script.preset,
            **({"sizes": dict(sorted(script.sizes.items()))} if script.sizes else {}),
            "faults": list(script.faults), "seed": script.seed,
            **({"hypothesis_version": script.hypothesis_version}
               if script.hypothesis_version is not None else {}),
            "implementation": script.implementation,
            "ops": [op_to_json(op) for op in script.ops]}


def script_from_json(raw: Any) -> Script:
    if not isinstance(raw, dict):
        raise ScriptError("script: expected a JSON object")
    if raw.get("version") != SCRIPT_VERSION:
        raise ScriptError(f"script: unsupported version {raw.get('version')!r}")
    cell = _field(raw, "cell", str, "script")
    preset = _field(raw, "preset", str, "script")
    try:
        get_cell(cell)
    except KeyError as error:
        raise ScriptError(f"script: {error.args[0]}") from None
    if preset not in PRESETS:
        raise ScriptError(f"script: unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    sizes = raw.get("sizes", {})
    if not isinstance(sizes, dict):
        raise ScriptError("script: field 'sizes' must be an object such as "
                          "{\"kv_tokens\": 16}")
    try:
        config = ModelConfig(get_cell(cell), make_preset(preset, sizes))
    except UsageError as error:
        raise ScriptError(f"script: {error}") from None
    problem = check_sizes(config)
    if problem is not None:
        raise ScriptError(f"script: {problem}")
    ops = [op_from_json(op, i) for i, op in enumerate(_field(raw, "ops", list, "script"))]
    check_op_ranges(config, ops)
    faults = raw.get("faults", [])
    if not isinstance(faults, list) or not all(isinstance(f, str) for f in faults):
        raise ScriptError("script: field 'faults' must be a list of bug IDs such as \"B3\"")
    unknown = set(faults) - SUPPORTED_FAULTS
    if unknown:
        raise ScriptError(f"script: unknown fault IDs {sorted(unknown)}; supported: "
                          f"{sorted(SUPPORTED_FAULTS)}")
    seed = raw.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ScriptError(f"script: field 'seed' must be an integer or null, got {seed!r}")
    hypothesis_version = raw.get("hypothesis_version")
    if hypothesis_version is not None and not isinstance(hypothesis_version, str):
        raise ScriptError("script: field 'hypothesis_version' must be a string such as "
                          f"\"6.170.15\", got {hypothesis_version!r}")
    implementation = raw.get("implementation", "reference")
    if implementation not in IMPLEMENTATIONS:
        raise ScriptError(f"script: unknown implementation {implementation!r} "
                          f"(available: {', '.join(IMPLEMENTATIONS)})")
    return Script(cell, preset, ops, tuple(faults), seed, implementation, dict(sizes),
                  hypothesis_version)


@dataclass(frozen=True)
class OpLimits:
    """The allowed range of every numeric op field in one configuration: the ranges the
    checkers draw from (``harness.drive.generate``; the BMC's domains in ``proofs.bmc``)."""

    prompt_len: tuple[int, int]
    max_new_tokens: tuple[int, int]
    retract: tuple[int, int]
    accept_len: tuple[int, int]
    batch_positions: int  # accept_lens entries and eos_positions index the batch's rows
    spec_steps: tuple[int, int]
    eos_offset: tuple[int, int]


# Abort indices are taken modulo the requests admitted so far; the state machine draws
# them below its MAX_REQUESTS (harness.drive.stateful; a test checks the two agree), so a
# saved counterexample may name one past the count.
ABORT_INDEX_LIMIT = 6


def get_op_limits(config: ModelConfig) -> OpLimits:
    preset = config.preset
    top = config.max_accept_len
    return OpLimits(
        # Up to the context length: the scheduler caps max_new_tokens to what fits and
        # refuses a prompt of max_req_len - 5 or more (spec.transitions.compute_admission).
        prompt_len=(1, preset.max_context_len - 1),
        max_new_tokens=(1, preset.max_new_tokens),
        retract=(0, preset.max_running_requests),
        accept_len=(1, top),
        batch_positions=preset.max_running_requests,
        # The adaptive rung: 0 is the configured maximum; only v2chain cells adapt, the
        # others ignore it (and the state machine may still draw 1 there).
        spec_steps=(0, preset.chain_steps),
        eos_offset=(0, top - 1),
    )


def _check_range(where: str, name: str, value: int, allowed: tuple[int, int],
                 meaning: str) -> None:
    low, high = allowed
    if not low <= value <= high:
        raise ScriptError(f"{where}: field {name!r} is {value}; allowed {low}..{high} "
                          f"({meaning})")


def check_op_ranges(config: ModelConfig, ops: list[Op]) -> None:
    """Every numeric field of every op within ``config``'s limits, else a
    :class:`ScriptError` naming the op, the field, the value and the allowed range."""
    limits = get_op_limits(config)
    rows = limits.batch_positions
    name = config.name
    admitted = 0
    for index, op in enumerate(ops):
        if isinstance(op, Admit | AdmitPrebuilt):
            where = f"op {index} ({'admit' if isinstance(op, Admit) else 'admit_prebuilt'})"
            _check_range(where, "prompt_len", op.prompt_len, limits.prompt_len,
                         f"below the max_context_len of {name}")
            _check_range(where, "max_new_tokens", op.max_new_tokens, limits.max_new_tokens,
                         f"max_new_tokens of {name}")
            admitted += 1
        elif isinstance(op, Abort):
            _check_range(f"op {index} (abort)", "request", op.request,
                         (0, max(admitted, ABORT_INDEX_LIMIT) - 1),
                         f"an index into the {admitted} request(s) admitted before it, "
                         "taken modulo their count")
        elif isinstance(op, Iterate):
            where = f"op {index} (iterate)"
            choices = op.choices
            _check_range(where, "retract", choices.retract, limits.retract,
                         f"the request rows of {name}")
            if len(choices.accept_lens) > rows:
                raise ScriptError(f"{where}: field 'accept_lens' has {len(choices.accept_lens)}"
                                  f" entries; allowed at most {rows} (one per request row of "
                                  f"{name})")
            for value in choices.accept_lens:
                _check_range(where, "accept_lens", value, limits.accept_len,
                             f"an accept length, bonus token included, in {name}")
            for value in sorted(choices.eos_positions):
                _check_range(where, "eos_positions", value, (0, rows - 1),
                             f"a position in the batch of {name}")
            _check_range(where, "spec_steps", choices.spec_steps, limits.spec_steps,
                         f"the adaptive rung, 0 for the configured maximum, in {name}")
            _check_range(where, "eos_offset", choices.eos_offset, limits.eos_offset,
                         f"tokens before the end of the accepted run in {name}")


def save_script(script: Script, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(script_to_json(script), indent=1) + "\n")
    return path


def load_script(path: Path) -> Script:
    """The script in ``path``; any unreadable, malformed or out-of-range input is a
    :class:`ScriptError` that names the file."""
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ScriptError(f"{path}: not JSON (line {error.lineno}: {error.msg})") from None
    except UnicodeDecodeError:
        raise ScriptError(f"{path}: not JSON (not UTF-8 text)") from None
    except OSError as error:
        raise ScriptError(f"{path}: cannot read: {error.strerror or error}") from None
    except (ValueError, RecursionError) as error:
        # JSON the parser refuses: numbers too long, nesting too deep.
        raise ScriptError(f"{path}: not JSON ({error})") from None
    try:
        return script_from_json(raw)
    except ScriptError as error:
        raise ScriptError(f"{path}: {error}") from None


Factory = Callable[[ModelConfig, frozenset[str], Observer | None], SchedulerModel]


# "gpu_impl" scripts are counterexamples of the differential checker: gpu_impl (with the
# script's faults) against the clean reference (harness.differential.compare.run_differential).
# "upstream" scripts replay on sglang's own scheduler (upstream/, its own environment);
# "upstream-differential" ones replay the reference against it
# (harness.conformance.tier.replay_differential; 'overlap-spec upstream replay').
IMPLEMENTATIONS = ("reference", "gpu_impl", "upstream", "upstream-differential")


def get_factory(implementation: str) -> Factory:
    if implementation == "reference":
        return Scheduler
    if implementation == "gpu_impl":
        raise ScriptError("a gpu_impl script replays against the reference "
                          "(harness.differential.compare.run_differential; 'overlap-spec replay')")
    if implementation == "upstream":
        from overlap_spec.upstream.adapter import make_upstream  # needs the upstream environment

        return make_upstream
    if implementation == "upstream-differential":
        raise ScriptError("an upstream-differential script replays the reference against "
                          "sglang ('overlap-spec upstream replay')")
    raise ScriptError(f"unknown implementation {implementation!r} "
                      f"(available: {', '.join(IMPLEMENTATIONS)})")


def apply_op(model: SchedulerModel, op: Op, admitted: list[RequestId]) -> None:
    if isinstance(op, Admit):
        family = {} if op.family is None else {"family": op.family}
        admitted.append(model.admit(op.prompt_len, op.max_new_tokens, **family))
    elif isinstance(op, AdmitPrebuilt):
        admitted.append(model.admit_prebuilt(op.prompt_len, op.max_new_tokens))
    elif isinstance(op, Abort):
        if admitted:
            model.abort(admitted[op.request % len(admitted)])
    elif isinstance(op, Flush):
        model.flush_cache()
    elif isinstance(op, PauseRetract):
        model.pause_generation()
    elif isinstance(op, Continue):
        model.continue_generation()
    else:
        model.run_iteration(op.choices)


@dataclass
class RunOutcome:
    violation: InvariantViolation | None
    failed_at: int | None
    checker: InvariantChecker
    crashed: Crash | None = None  # with catch_crash: the model raised this (never a pass)

    @property
    def crash(self) -> str | None:
        """The crash as "Type: message" (None: no crash)."""
        return None if self.crashed is None else f"{self.crashed.exception}: {self.crashed.message}"


def run_script(script: Script, catch_crash: bool = False) -> RunOutcome:
    """Replay ``script`` on its implementation, checking every invariant after every step.

    A crash of the model propagates, unless ``catch_crash``: then it is returned as
    ``crash`` with the op it happened at (a replay reports it; it is never a pass)."""
    config = script.get_config()
    checker = InvariantChecker(config)
    model = get_factory(script.implementation)(config, frozenset(script.faults), checker)
    admitted: list[RequestId] = []
    for index, op in enumerate(script.ops):
        model.set_step_index(index)
        try:
            apply_op(model, op, admitted)
        except InvariantViolation as violation:
            return RunOutcome(violation, index, checker)
        except Exception as error:
            if not catch_crash:
                raise
            return RunOutcome(None, index, checker, Crash.of(error))
    return RunOutcome(None, None, checker)
