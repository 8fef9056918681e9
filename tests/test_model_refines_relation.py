"""proofs/model.py against spec/relation.py, transition by transition, on concrete values.

The model takes a request's record fields from the relation (its integer cores and its
transitions, lifted over Z3 terms), but the guards, the ghost's queue of launched steps
(a map with epochs in the relation, two accept lengths here) and the fold of the prefill's
launch into ``prepare_for_extend`` are the model's own. Here both run side by side: random
walks from an admission, in every cell, where each step is a model transition whose guard
holds, evaluated on literal terms, and the relation's transitions that make the same step
of the scheduler. After every step each field the two share must agree, and a step the
model allows must be one the relation allows (a GuardViolation fails the test).

A mismatch names the cell, the seed and the walk so far. ``test_the_comparison_fails_on_a_
model_that_departs`` shows the walk catches a model that departs from the relation.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from overlap_spec.proofs import model
from overlap_spec.proofs import solver as zs
from overlap_spec.proofs.model import Context, Record
from overlap_spec.spec import relation
from overlap_spec.spec.config import MINIMAL, ModelConfig, get_cell
from overlap_spec.spec.units import PoolRow, RequestId, StepId, TokenCount

SEED = 20261129
WALKS_PER_CELL = 8
STEPS_PER_WALK = 24
# A retraction ends a walk's decoding for a while and an EOS ends the walk, so both are
# drawn at a fraction of the others' weight (an EOS at each of its three offsets) and most
# walks reach live decode results.
WEIGHTS = {"retract_decode": 0.25, "eos": 0.07}


def _literal(value: int | bool) -> zs.Term:
    return zs.BoolVal(value) if isinstance(value, bool) else zs.IntVal(value)


def _value(term: zs.Term) -> int | bool:
    value = zs.as_python(term)
    assert value is not None, f"not a literal on concrete input: {term}"
    return value


@dataclass
class Walk:
    """One request, as the model's record (Python values) and as the relation's."""

    ctx: Context
    prompt_len: int
    max_new_tokens: int
    model: dict[str, int | bool] = field(default_factory=dict)
    request: relation.RequestRecord | None = None
    queue: list[tuple[StepId, str, int]] = field(default_factory=list)  # launched steps
    steps: int = 0
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model = {name: 0 for name in model.INT_FIELDS}
        self.model.update({name: False for name in model.BOOL_FIELDS})
        self.model.update(prompt_len=self.prompt_len, max_new_tokens=self.max_new_tokens)
        self.request = relation.admit(RequestId(1), TokenCount(self.prompt_len),
                                      TokenCount(self.max_new_tokens))

    def record(self) -> Record:
        return {name: _literal(value) for name, value in self.model.items()}

    def next_step(self) -> StepId:
        self.steps += 1
        return StepId(self.steps)


def _choices(walk: Walk) -> Iterator[tuple[str, Callable[[Record], model.Step], object]]:
    """Every model transition instance with concrete parameters: (name, build, parameter)."""
    ctx = walk.ctx
    names = model.get_request_transitions(ctx)
    for name in names:
        if name == "prepare_for_decode":
            for shape in ctx.shapes:
                yield name, lambda r, s=shape: model.prepare_for_decode(ctx, r, s), shape
        elif name == "launch":
            top = max(shape.max_accept_len for shape in ctx.shapes) if ctx.is_spec else 1
            for accept in range(1, top + 1):
                yield name, lambda r, a=accept: model.launch(ctx, r, zs.IntVal(a)), accept
        elif name == "process_result":
            for eos_at in (None, 0, 1, 2):
                yield name, lambda r, e=eos_at: model.process_result(
                    ctx, r, zs.BoolVal(e is not None), zs.IntVal(e or 0)), eos_at
        else:
            builder = {"prepare_for_extend": model.prepare_for_extend,
                       "resolve_seq_lens_cpu": model.resolve_seq_lens_cpu,
                       "retract_decode": model.retract, "readmit": model.readmit}[name]
            yield name, lambda r, b=builder: b(ctx, r), None


def _apply_relation(walk: Walk, name: str, parameter: object, notes: dict[str, object]) -> None:
    """The relation's transitions for the step the model took."""
    ctx, cell, req = walk.ctx, walk.ctx.config.cell, walk.request
    assert req is not None
    if name in ("prepare_for_extend", "readmit"):  # the prefill, its launch and forward
        step = walk.next_step()
        req = relation.launch(relation.prepare_for_extend(req, PoolRow(1)), step)
        fill = req.prompt_len + req.output_len
        req = relation.forward_extend(req, step, fill)
        walk.queue.append((step, "extend", 1))
    elif name == "prepare_for_decode":
        shape = parameter
        if ctx.is_spec:
            req = relation.prepare_for_decode_spec_v2(
                req, ctx.get_reserve(shape), ctx.config.page_size,  # type: ignore[arg-type]
                cell.preclaim, ctx.faults)
        else:
            req = relation.prepare_for_decode(req, int(walk.model["seq_len"]))
    elif name == "launch":
        accept = int(parameter)  # type: ignore[call-overload]
        step = walk.next_step()
        req = relation.launch(req, step)
        req = relation.forward_decode(req, step, accept if ctx.is_spec else 1)
        walk.queue.append((step, "decode", accept))
    elif name == "process_result":
        step, mode, accept = walk.queue.pop(0)
        eos_at = parameter if isinstance(parameter, int) else None
        finished_before = req.is_finished()
        req = relation.process_result(req, cell, step, mode, accept, eos_at,
                                      tuple(range(100, 100 + accept)), ctx.faults)
        if req.is_finished() and not finished_before:
            allocated = req.kv_allocated_len
            req = relation.release_kv_cache(req, cell, True, ctx.faults)
            cached = int(notes["cached"])  # type: ignore[call-overload]
            assert req.cached_len == max(0, min(cached, allocated)), (
                f"cached: model {cached} (cut to {allocated}), relation {req.cached_len}")
    elif name == "retract_decode":
        req = relation.reset_for_retract(relation.release_kv_cache(req, cell, False))
    walk.request = req


def _mismatches(walk: Walk) -> list[str]:
    """The fields the model and the relation share, where they differ."""
    req, m = walk.request, walk.model
    assert req is not None
    live = bool(m["holds_kv"]) and not m["finished"] and not m["is_retracted"]
    shared: dict[str, tuple[object, object]] = {
        "kv_committed_len": (m["kv_committed_len"], req.kv_committed_len),
        "output_len": (m["output_len"], req.output_len),
        "finished": (m["finished"], req.is_finished()),
        "holds_kv": (m["holds_kv"], req.holds_kv),
        "is_retracted": (m["is_retracted"], req.is_retracted),
        "kv_len_true": (m["kv_len_true"], req.ghost.kv_len_true),
        "launched_steps": (m["launched_steps"], len(req.ghost.steps)),
        "extend_inflight": (m["extend_inflight"], bool(walk.queue)
                            and req.ghost.steps[walk.queue[0][0]].is_extend),
    }
    if m["holds_kv"]:  # a released record's allocation is 0 in both; the model keeps it
        shared["kv_allocated_len"] = (m["kv_allocated_len"], req.kv_allocated_len)
    if not m["finished"] and not m["extend_inflight"]:
        # The ghost's truth stops at the finish. The model settles the prefill with its
        # folded launch, the relation at the prefill's result.
        shared["settled_len"] = (m["settled_len"], req.ghost.settled_len)
    if live:  # the re-filter drops a finished request's prepared step in the model only
        shared["prepared"] = (m["prepared"], req.ghost.prepared_steps == 1)
    if walk.queue:
        shared["accept_oldest"] = (m["accept_oldest"], walk.queue[0][2]
                                   if walk.queue[0][1] == "decode" else m["accept_oldest"])
    return [f"{k}: model {a!r}, relation {b!r}" for k, (a, b) in shared.items() if a != b]


def run_walk(cell_name: str, seed: int,
             process_result: Callable[..., model.Step] | None = None) -> list[str]:
    """One random walk; the problems found (empty when the model refines the relation)."""
    rng = random.Random(seed)
    ctx = Context(ModelConfig(get_cell(cell_name), MINIMAL))
    walk = Walk(ctx, rng.randint(1, MINIMAL.max_prompt_len),
                rng.choice((0, 1, *range(2, MINIMAL.max_new_tokens + 1))))
    for _ in range(STEPS_PER_WALK):
        record = walk.record()
        enabled = []
        for name, build, parameter in _choices(walk):
            if name == "process_result" and process_result is not None:
                step = process_result(ctx, record, zs.BoolVal(parameter is not None),
                                      zs.IntVal(parameter or 0))  # type: ignore[operator]
            else:
                step = build(record)
            if _value(step.guard):
                enabled.append((name, step, parameter))
        if not enabled:
            break
        weights = [WEIGHTS["eos"] if n == "process_result" and p is not None
                   else WEIGHTS.get(n, 1.0) for n, _, p in enabled]
        name, step, parameter = rng.choices(enabled, weights)[0]
        walk.log.append(f"{name}({parameter})")
        notes = {k: _value(v) for k, v in step.notes.items()}
        try:
            _apply_relation(walk, name, parameter, notes)
        except relation.GuardViolation as error:
            return [f"{cell_name} seed {seed}: the relation refuses {walk.log}: {error}"]
        except AssertionError as error:
            return [f"{cell_name} seed {seed}: {walk.log}: {error}"]
        walk.model = {k: _value(v) for k, v in step.post.items()}
        problems = _mismatches(walk)
        if problems:
            return [f"{cell_name} seed {seed} after {walk.log}: {p}" for p in problems]
    return []


def test_the_model_refines_the_relation_on_concrete_walks(tier_cell: str) -> None:
    """Six cells by default, the other 26 under ``-m slow`` (tests/conftest.py)."""
    problems = [p for i in range(WALKS_PER_CELL) for p in run_walk(tier_cell, SEED + i)]
    assert not problems, "\n".join(problems[:5])


def test_the_comparison_fails_on_a_model_that_departs() -> None:
    """A model whose results commit one slot too many on a live decode is caught."""

    def departing(ctx: Context, r: Record, eos: zs.Term, eos_at: zs.Term) -> model.Step:
        step = model.process_result(ctx, r, eos, eos_at)
        bumped = zs.If(zs.And(zs.Not(step.notes["stale"]), zs.Not(step.notes["extend"])),
                       step.post["kv_committed_len"] + 1, step.post["kv_committed_len"])
        return model.Step(step.guard, {**step.post, "kv_committed_len": bumped}, step.notes)

    problems = [p for i in range(WALKS_PER_CELL) for p in
                run_walk("ov-p1-v2chain-cpu-honest", SEED + i, departing)]
    assert any("kv_committed_len" in p for p in problems), problems
