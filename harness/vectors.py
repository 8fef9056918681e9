"""Conformance vectors: language-neutral JSON files, one transition each, across every cell.

A vector is one script operation in one cell: the operations that lead to its
pre state (``prefix``), the ``pre`` state (the last observation before the op),
the op's ``events`` (op, stream and observe events in the trace schema), and the
``post`` outcome: the state after the op, or ``invalid`` with the invariant ID,
every ID that failed and the violating state. Valid vectors come from seeded
random scripts with no fault; invalid ones from the same generator with one
historical bug switched on (the first violating op becomes the vector).

``overlap-spec vectors generate DIR`` writes them with a README (the format, for
consumers that do not install this project); ``vectors check DIR`` replays each
one on the reference and re-checks its states with the spec's invariants.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from overlap_spec.harness.catalogue import BUGS
from overlap_spec.harness.drive.cells import (
    DEFAULT_SEED,
    SIZE_LIMITS,
    SIZES_MARK,
    UsageError,
    make_preset,
)
from overlap_spec.harness.drive.checker import InvariantChecker, describe_id_ranges
from overlap_spec.harness.drive.generate import generate_random_ops
from overlap_spec.harness.drive.script import (
    Script,
    check_op_ranges,
    op_from_json,
    op_to_json,
)
from overlap_spec.harness.trace.codec import CodecError, decode_dataclass, encode_value
from overlap_spec.harness.trace.format import TraceFormatError
from overlap_spec.harness.trace.record import RecordedRun, record_script
from overlap_spec.spec.config import PRESETS, ModelConfig, enumerate_cells, enumerate_radix_cells
from overlap_spec.spec.invariants import INVARIANT_IDS, InvariantViolation
from overlap_spec.spec.state import Observation

VECTOR_FORMAT = "overlap-spec-vector"
VECTOR_VERSION = 1


def _config_json(config: ModelConfig) -> dict[str, Any]:
    cell = config.cell
    return {
        "cell": {"name": cell.name, "overlap": cell.overlap, "page_size": cell.page_size,
                 "spec_mode": cell.spec_mode.value,
                 "needs_cpu_seq_lens": cell.needs_cpu_seq_lens, "preclaim": cell.preclaim},
        "preset": dataclasses.asdict(config.preset),
        "derived": {"topk": config.topk, "spec_steps": config.spec_steps,
                    "draft_tokens": config.draft_tokens,
                    "alloc_len_per_decode": config.alloc_len_per_decode,
                    "lag_bound": config.lag_bound, "row_width": config.row_width,
                    "max_accept_len": config.max_accept_len, "kv_pages": config.kv_pages},
    }


def _op_events(run: RecordedRun, step: int) -> list[dict[str, Any]]:
    """The events of op ``step``, renumbered from 0, without state snapshots."""
    events = [e for e in run.recorder.events
              if e.get("step") == step and e["event"] in ("op", "stream", "observe")]
    out = []
    for k, e in enumerate(events):
        item = {key: value for key, value in e.items() if key != "state"}
        item["id"] = k
        out.append(item)
    return out


def _last_state(run: RecordedRun, before_step: int) -> Observation | None:
    states = [obs for _, obs in run.recorder.observations if obs.step_index < before_step]
    return states[-1] if states else None


def build_vector(script: Script, step: int, run: RecordedRun, name: str) -> dict[str, Any]:
    """The vector for op ``step`` of a recorded run (which stopped at or after it)."""
    pre = _last_state(run, step)
    vector: dict[str, Any] = {
        "format": VECTOR_FORMAT, "version": VECTOR_VERSION, "name": name,
        **_config_json(script.get_config()), "faults": list(script.faults),
        "prefix": [op_to_json(op) for op in script.ops[:step]],
        "pre": None if pre is None else encode_value(pre),
        "events": _op_events(run, step),
    }
    if run.violation is not None and run.failed_at == step:
        violating = run.recorder.observations[-1][1]
        index = next(e["id"] for e in reversed(vector["events"]) if e["event"] == "observe")
        vector["post"] = {"valid": False, "invariant": run.violation.invariant_id,
                          "all": list(run.violation.all_ids), "event": index,
                          "message": str(run.violation).split("\n", 1)[0],
                          "state": encode_value(violating)}
    else:
        post = [obs for _, obs in run.recorder.observations if obs.step_index == step]
        vector["post"] = {"valid": True, "state": encode_value(post[-1]) if post else None}
    return vector


@dataclass
class GenerationReport:
    written: int = 0
    valid: int = 0
    invalid: int = 0
    invalid_by_bug: dict[str, int] = dataclasses.field(default_factory=dict)
    missing: list[str] = dataclasses.field(default_factory=list)  # bug@cell never tripped
    seconds: float = 0.0


# Invariants that judge observation fields the trace codec does not write (``metadata
# {"trace": False}``): a vector of their violation would replay as a state the spec accepts.
# KV14 reads each request's KV contents and its prebuilt mark; a try that trips it first
# is not kept (B36, which trips only it, has no vectors; KV14's kills are the mutant
# matrix's and the exhaustive tier's).
UNSERIALISED_INVARIANTS: Final = frozenset({"KV14"})


def generate_vectors(directory: Path, seed: int = DEFAULT_SEED, scripts_per_cell: int = 4,
                     ops_per_script: int = 6, fault_tries: int = 60,
                     preset: str = "minimal") -> GenerationReport:
    """Write valid vectors (every op of seeded random clean scripts) and one invalid vector
    per (bug, cell) the random search trips, for every cell, the radix cells included (a
    radix bug's vectors in those, the others' in the cells without the cache)."""
    started = time.perf_counter()
    report = GenerationReport()
    index: list[dict[str, Any]] = []
    directory.mkdir(parents=True, exist_ok=True)
    for cell in (*enumerate_cells(), *enumerate_radix_cells()):
        config = ModelConfig(cell, PRESETS[preset])
        rng = random.Random(f"{seed}:{cell.name}")
        count = 0

        def emit(vector: dict[str, Any], cell_name: str = cell.name) -> None:
            nonlocal count
            path = directory / cell_name / f"{count:04d}.json"
            count += 1
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(vector, separators=(",", ":")) + "\n")
            post = vector["post"]
            index.append({"file": str(path.relative_to(directory)), "cell": cell_name,
                          "faults": vector["faults"], "valid": post["valid"],
                          "invariant": post.get("invariant")})
            report.written += 1
            if post["valid"]:
                report.valid += 1
            else:
                report.invalid += 1

        for k in range(scripts_per_cell):
            script = Script(cell.name, preset, generate_random_ops(config, rng, ops_per_script))
            run = record_script(script, snapshots=False)
            if run.violation is not None or run.crash is not None:
                raise AssertionError(f"clean run failed in {cell.name}: "
                                     f"{run.violation or run.crash}")
            for step in range(len(script.ops)):
                emit(build_vector(script, step, run, f"{cell.name}/clean-{k}-op{step}"))
        for bug in BUGS:
            # A vector's verdict is an invariant ID; a bug that was only a crash (B25) has
            # none (B2, killed by SL1 or by its crash, keeps its vectors).
            if bug.radix != cell.radix or not bug.applies(cell) or not bug.invariants:
                continue
            sized = ModelConfig(cell, make_preset(preset, dict(bug.sizes)))  # B18: chunks
            for _ in range(fault_tries):
                script = Script(cell.name, preset,
                                generate_random_ops(sized, rng, ops_per_script + 4),
                                (bug.id,), sizes=dict(bug.sizes))
                run = record_script(script, snapshots=False)
                if run.violation is not None and run.failed_at is not None and (
                        run.violation.invariant_id not in UNSERIALISED_INVARIANTS):
                    emit(build_vector(script, run.failed_at, run,
                                      f"{cell.name}/{bug.id}-op{run.failed_at}"))
                    report.invalid_by_bug[bug.id] = report.invalid_by_bug.get(bug.id, 0) + 1
                    break
            else:
                report.missing.append(f"{bug.id}@{cell.name}")
    (directory / "index.json").write_text(json.dumps(
        {"format": VECTOR_FORMAT, "version": VECTOR_VERSION, "seed": seed,
         "vectors": index}, indent=0) + "\n")
    ranges = describe_id_ranges(INVARIANT_IDS)  # the registry's, never restated here
    (directory / "README.md").write_text(VECTORS_README.replace("ID_RANGES", ranges))
    report.seconds = time.perf_counter() - started
    return report


# ----------------------------------------------------------------------------- checking
@dataclass(frozen=True)
class VectorFailure:
    file: str
    reason: str


def _decode_state(raw: Any, where: str) -> Observation:
    try:
        return decode_dataclass(Observation, raw, "state")
    except CodecError as error:
        raise TraceFormatError(None, error.path, f"{where}: {error.message}") from None


def check_vector(vector: dict[str, Any], file: str) -> VectorFailure | None:
    """Replay one vector on the reference and re-check its states with the spec alone."""
    if vector.get("format") != VECTOR_FORMAT or vector.get("version") != VECTOR_VERSION:
        return VectorFailure(file, "not an overlap-spec-vector version 1 file")
    ops = [op_from_json(op, i) for i, op in enumerate([*vector["prefix"],
                                                        _op_of(vector["events"])])]
    step = len(ops) - 1
    base = str(vector["preset"]["name"]).split(SIZES_MARK, 1)[0]
    sizes = {name: vector["preset"][name] for name in SIZE_LIMITS
             if name in vector["preset"] and base in PRESETS
             and vector["preset"][name] != getattr(PRESETS[base], name)}
    script = Script(vector["cell"]["name"], base, ops, tuple(vector["faults"]), sizes=sizes)
    check_op_ranges(script.get_config(), ops)
    run = record_script(script, snapshots=False)
    again = build_vector(script, step, run, vector["name"])
    for part in ("pre", "events", "post"):
        if again[part] != vector[part]:
            return VectorFailure(file, f"the reference no longer reproduces '{part}'")
    # The spec alone: the post state passes, or the violating state fails with the ID.
    config = script.get_config()
    post = vector["post"]
    if post["state"] is None:
        return None
    state = _decode_state(post["state"], file)
    try:
        InvariantChecker(config)(state)
    except InvariantViolation as violation:
        if post["valid"]:
            return VectorFailure(file, f"the spec rejects the valid post state: {violation}")
        if post["invariant"] != violation.invariant_id:
            return VectorFailure(file, f"the spec reports {violation.invariant_id}, the "
                                 f"vector expects {post['invariant']}")
        return None
    if not post["valid"]:
        return VectorFailure(file, f"the spec accepts the violating state ({post['invariant']})")
    return None


def _op_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    op = next(e for e in events if e["event"] == "op")
    return {k: v for k, v in op.items() if k not in ("id", "event", "step")}


def check_vectors(directory: Path) -> tuple[int, list[VectorFailure]]:
    """Replay every vector under ``directory``; returns (count, failures)."""
    files = sorted(p for p in directory.rglob("*.json") if p.name != "index.json")
    failures: list[VectorFailure] = []
    for path in files:
        name = str(path.relative_to(directory))
        try:
            vector = json.loads(path.read_text())
            failure = check_vector(vector, name)
        except (KeyError, TypeError, ValueError, StopIteration, OSError,
                RecursionError) as error:
            failure = VectorFailure(name, f"malformed vector: {type(error).__name__}: {error}")
        if failure is not None:
            failures.append(failure)
    return len(files), failures


# ----------------------------------------------------------------------------- CLI
def cmd_vectors(args: argparse.Namespace) -> int:
    """``overlap-spec vectors generate DIR / check DIR`` (arguments: ``harness.cli``).
    Exit codes: 0 all vectors written / replayed green, 1 a vector failed; a usage error
    raises (exit 2)."""
    directory = Path(args.dir)
    if args.vectors_command == "generate":
        report = generate_vectors(directory, args.seed, args.scripts_per_cell,
                                  args.ops_per_script, args.fault_tries)
        print(f"wrote {report.written} vectors ({report.valid} valid, {report.invalid} "
              f"invalid) to {directory} in {report.seconds:.1f}s")
        if report.missing:
            print(f"no invalid vector found for {len(report.missing)} bug/cell pairs: "
                  f"{', '.join(report.missing)}")
        return 0
    started = time.perf_counter()
    count, failures = check_vectors(directory)
    for failure in failures:
        print(f"FAIL {failure.file}: {failure.reason}")
    if count == 0:
        raise UsageError(f"no vectors under {directory}")
    print(f"{'OK' if not failures else 'FAILED'}: {count - len(failures)}/{count} vectors "
          f"replayed green in {time.perf_counter() - started:.1f}s")
    return 0 if not failures else 1


VECTORS_README = """\
# overlap-spec conformance vectors (format `overlap-spec-vector`, version 1)

Each `<cell>/<nnnn>.json` file is one transition of SGLang's overlap scheduler
(speculative decoding v2 where the cell says so), judged by the overlap-spec
model. The files are plain JSON; a consumer needs no part of this project.

Keys of a vector:

- `cell`: the design switches: `overlap` (enable_overlap), `page_size`,
  `spec_mode` (`none`; `v2chain`: EAGLE topk 1; `v2tree`: topk > 1),
  `needs_cpu_seq_lens` (FutureMap), `preclaim` (the J2-era bonus pre-claim,
  PR 23456; false: PR 28754).
- `preset`, `derived`: sizes: `max_running_requests` (req_to_token rows),
  `kv_tokens`, the draft shape; `derived` holds `draft_tokens` (D_tok),
  `alloc_len_per_decode` (A), `lag_bound`, `row_width`.
- `faults`: historical bugs switched on (B1..B25; B25, a crash, has no vectors); empty
  for a correct design.
- `prefix`: the operations from an empty scheduler to the pre state (the same
  objects as the `op` event).
- `pre`: the state at the last observation point before the operation, or null.
- `events`: the operation and what it did, in order: one `op` event, then
  `stream` events (`record`, `wait_event`, `wait_stream`, `synchronize_event`,
  `synchronize_stream`, `read`, `write`, `free`, `enqueue`) and `observe` events
  (the observation points, e.g. `prepare_for_decode`).
- `post`: `{"valid": true, "state": ...}`, the state at the end of the
  operation; or `{"valid": false, "invariant": "KV3", "all": [...], "event": k,
  "message": "...", "state": ...}`: the first observation (`events[k]`) that
  breaks the invariant, and that state.

Operations: `admit {prompt_len, max_new_tokens}`; `admit_prebuilt` (PD decode: KV and
first token arrive without a prefill); `abort {request}` (index in admission order);
`iterate {allow_prefill, retract, accept_lens, eos_positions, disable_overlap,
spec_steps, eos_offset}`: one pass of `event_loop_overlap` (or `event_loop_normal`)
where request j of the launched batch accepts `accept_lens[j % len]` tokens (bonus
included, clamped to 1..steps+1) and emits EOS if j is in `eos_positions`.

A state (`pre`, `post.state`) holds `requests` (per `Req`: `kv_committed_len`,
`kv_allocated_len`, `req_pool_idx`, `output_len`, ..., and `ghost`: the true KV length and
output count the scheduler does not keep), `batch` (the `ScheduleBatch`: `seq_lens`,
`seq_lens_cpu`, `seq_lens_sum`, `req_pool_indices`, `future_indices`), `forward` (a
`ForwardBatch` at `init_new`), `launch`, `resolve`, `result`, `allocator`, and `races`
(unsynchronised access pairs). Field names follow upstream; see docs/trace-format.md
for the table mapping each field to its SGLang field or method.

How an SGLang unit test can use them:

1. *Invariant predicates*: feed `post.state` to your own checks; valid vectors must
   pass, invalid ones must fail with `post.invariant` (IDs ID_RANGES of the
   overlap-spec digest; `overlap-spec invariants` states each).
2. *Scheduler conformance*: drive a scheduler with `prefix` then the `op` of `events`,
   map its `ScheduleBatch` / `Req` fields at each observation point and compare with
   the `observe` points and `post.state` (fields you do not model can be skipped).
3. *Stream ordering*: replay the `stream` events through a vector-clock
   happens-before checker (e.g. torch.cuda._sanitizer's rule); a `races` entry in the
   state is a pair with no edge.

`index.json` lists every file with its cell, faults, validity and invariant.
Regenerate with `overlap-spec vectors generate DIR`; replay with
`overlap-spec vectors check DIR`.
"""

