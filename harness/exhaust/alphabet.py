"""The exhaustive tier's operation alphabet, and the oracle that enumerates iterations.

One cell's alphabet (:func:`get_alphabet`) is a finite set of script operations
(:mod:`overlap_spec.harness.drive.script`); at most two requests are admitted on a path.
This is the ``full`` alphabet, the tier's default; the ``pd-decode`` one is at the end.

==================  =====================================================================
operation           values
==================  =====================================================================
admit               prompt_len 1; max_new_tokens 2 (finishes by length at its first
                    decode, or earlier by EOS) and the preset's maximum, 8 (still
                    running at the depth bound unless EOS or an abort ends it); in
                    non-speculative cells (and with ``mixed_chunk``) also the longest
                    prompt, which the pool caps to 0 new tokens or admission refuses:
                    a request with nothing to generate, RP8's witness
admit_prebuilt      prompt_len 1 and page_size - 1 where that differs (3 at page size
                    4: the prompt ends one slot short of a page; B16 at page size 4
                    with the pre-claim dies within four operations from it, and needs
                    five from prompt 1); max_new_tokens 8
abort(i)            every request admitted so far (running, waiting or finished)
iterate             every IterationChoices whose fields lie in the domains below, up
                    to what the model can tell apart
==================  =====================================================================

==================  =====================================================================
iterate field       domain
==================  =====================================================================
allow_prefill       True, False
retract             0, 1 (a forced retraction keeps one request, so with two any value
                    from 1 up retracts the same one; with one it retracts nothing and
                    re-estimates the new-token ratio)
disable_overlap     False, True in overlap cells (not read elsewhere)
spec_steps          0 (the configured shape) and 1 (the lowest rung) in v2chain cells,
                    so every iteration may switch the rung up or down by the widest
                    step; 0 elsewhere (``get_shape`` ignores it there)
accept_lens         one length 1..max_accept_len for the whole batch (1 without
                    speculation): ``(a, a, a)``
eos_positions       none, or one batch position (0 or 1); ``eos_offset`` 0: EOS is
                    the last token of that request's accepted run
==================  =====================================================================

Why these: each value is a boundary of the arithmetic it feeds. A request that finishes
at once and one that outlives the bound; a prompt inside one page and one that makes the
first reserve cross a page; no draft accepted and every draft accepted, and each length
between, since the page rounding of the reserve depends on the exact count; the widest
rung switch each way; the early result processing that ``disable_overlap`` forces and the
forced retraction. The kill matrix (``tests/test_exhaust.py``) shows the alphabet is
enough for every catalogue bug in every cell where it applies.

What it leaves out, and the Hypothesis tier samples: prompt lengths other than these,
max_new_tokens 1 and 3..7, different accept lengths for the requests of one batch, EOS
before the end of an accepted run or on two requests in one iteration, the intermediate
rung (2 of 3), retracting more than one request, a third request (so the pool rows and
the KV pool never fill: memory-pressure retraction and an admission refused for lack of
pages are out of reach), and every sequence longer than the depth bound.

**Enumerating iterations.** An iteration reads only some of its fields, and only through
a few members (``get_accept_len`` clamps, ``is_eos`` compares a position). So instead of
running the product of the domains, :class:`ChoiceOracle` answers each read lazily: the
first time the model reads a field it branches over the *distinct answers* the field's
remaining candidates give to that read, and narrows the field to the candidates that give
the chosen answer. :func:`get_next_decisions` walks the tree of those branch points depth
first, so one run per leaf covers every distinguishable iteration once. A field never
read keeps its first candidate in the replayable
:class:`~overlap_spec.harness.drive.script.Iterate` op (:meth:`ChoiceOracle.get_choices`),
which reads the same answers and runs the same. That rests on two facts about the model,
each checked by ``tests/test_exhaust.py``: it reads the choices only through the members
the oracle implements (any other read raises :class:`OracleReadError`), and it uses
``spec_steps`` only through ``config.get_shape``. Three fields do not branch where the
model's state makes them irrelevant (:func:`is_prefill_possible`,
:func:`is_retract_possible`, :func:`is_result_pending`, each restating the reference's
own guard); a test checks that the search reaches exactly the same states without them.

**The pd-decode alphabet** (``--alphabet pd-decode``) is a narrower scope for a deeper
search: the decode instance of PD disaggregation, where every request arrives prebuilt
(``admit_prebuilt`` with prompt_len as above and max_new_tokens 2 or the preset's
maximum), at the stream level: every iteration field keeps its first value above except
the EOS position, which ranges over none and each of up to three requests. It exists for
B9 under the release's fence, the stash race of a pool row that a prebuilt request
reuses while the forward that last held it is still in flight: that takes a request that
stops and runs once more, one that finishes by length and sits that decode out (so both
rows free in one result), and a third that takes the stopped one's row, in six
operations at two pool rows (``--sizes max_running_requests=2``); at the preset's three
rows it takes a fourth request and a seventh operation. The full alphabet cannot go that
deep (a sixth operation over it costs hours a cell); this one kills it in 10 to 20 s.

**The shared alphabet** (``--alphabet shared``, the radix cells' default, with ``--radix``)
is for the prefix tree: every admission is of family 0 (``Admit(..., family=0)``: one
prompt's tokens), :func:`get_shared_prompt_len` long, the shortest prompt a second request
matches a whole page of (a match covers at most ``input_len - 1`` tokens, keyed in whole
pages, of bigrams under EAGLE), with max_new_tokens 2 and the preset's maximum, and in
non-speculative cells the longest prompt as above (RP8); ``flush`` (``flush_cache``: it
runs at full idle, else is refused and changes nothing) is an operation too. Its
iterations vary the forced retraction, the accept length's two ends (1 and the most) and
the EOS position; the rest keep their first value. So the dedup (two requests prefilled
together, the second's checkpoint freeing its copy of the page) takes four operations and
the match (the second admitted after the first's prefill result) five under overlap, and
the default depth of 6 goes one past both.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Final, cast

from overlap_spec.harness.drive.script import Admit, AdmitPrebuilt
from overlap_spec.harness.exhaust import (
    FULL,
    MAX_REQUESTS,
    MAX_REQUESTS_BY_SCOPE,
    PD_DECODE,
    SHARED,
)
from overlap_spec.reference.scheduler import Scheduler
from overlap_spec.spec.config import ModelConfig, SpecShape
from overlap_spec.spec.state import IterationChoices

# The iteration fields the oracle chooses: one accept length for the whole batch, and the
# one batch position (or none) whose request hits EOS.
ACCEPT_LEN: Final = "accept_len"
EOS_POSITION: Final = "eos_position"
# The iteration fields the shared alphabet varies (the rest keep their first value); its
# accept length is only the two ends, 1 and the most (see get_alphabet).
SHARED_FIELDS: Final = frozenset({"retract", ACCEPT_LEN, EOS_POSITION})


@dataclass(frozen=True)
class Alphabet:
    """One cell's finite alphabet: the admissions, the request bound, and the candidate
    values of every iteration field (simplest first: the value a field the model never
    reads takes in the script)."""

    config: ModelConfig
    admissions: tuple[Admit | AdmitPrebuilt, ...]
    max_requests: int
    domains: dict[str, tuple[Hashable, ...]]
    rows: int  # batch positions the choices index (accept_lens, eos_positions)
    scope: str = FULL  # the alphabet's name (FULL, PD_DECODE or SHARED)
    flush: bool = False  # flush_cache is an operation (the shared alphabet's)
    # pause_generation(mode="retract") and continue_generation are operations (the full and
    # shared alphabets'; the PD decode instance's pause rebootstraps, which is not modelled)
    pause: bool = False

    def describe(self) -> str:
        """One line per kind of operation, for reports."""
        admits = ", ".join(f"{'admit' if isinstance(op, Admit) else 'admit_prebuilt'}"
                           f"({op.prompt_len},{op.max_new_tokens}"
                           + (f",family={op.family}" if isinstance(op, Admit)
                              and op.family is not None else "") + ")"
                           for op in self.admissions)
        varied = [f"{name} {list(values)}" for name, values in self.domains.items()
                  if len(values) > 1]
        plural = "s" * (self.max_requests != 1)
        named = "" if self.scope == FULL else f"{self.scope} alphabet: "
        flush = "; flush" if self.flush else ""
        pause = "; pause_retract; continue" if self.pause else ""
        return (f"{named}up to {self.max_requests} request{plural}; {admits}; "
                f"abort(each admitted){flush}{pause}; iterate over {'; '.join(varied)}")


def get_rungs(config: ModelConfig) -> tuple[int, ...]:
    """``spec_steps`` 0 (the configured maximum) and 1 (the lowest rung), one value per
    distinct shape: (0, 1) in v2chain cells, (0,) elsewhere (``get_shape`` ignores it)."""
    seen: dict[SpecShape, int] = {}
    for steps in (0, 1):
        seen.setdefault(config.get_shape(steps), steps)
    return tuple(seen.values())


def get_prompt_lens(config: ModelConfig) -> tuple[int, ...]:
    """1, and page_size - 1 where that differs: a prompt one slot short of a page, the
    residue a page-size-4 reserve overflow needs soonest (see the module docstring)."""
    return tuple(sorted({1, max(config.cell.page_size - 1, 1)}))


def get_shared_prompt_len(config: ModelConfig) -> int:
    """The shortest prompt whose first page of key a second request of its family shares:
    a match covers at most ``input_len - 1`` tokens and keys whole pages, of bigrams under
    EAGLE (every spec cell), so page + 1 tokens, one more under EAGLE: 2 or 3 at page 1, 5
    or 6 at page 4 (docs/upstream-radix-sharing.md section 5, step 5)."""
    return config.page_size + 1 + int(config.cell.is_spec)


def get_alphabet(config: ModelConfig, max_requests: int = MAX_REQUESTS,
                 scope: str = FULL) -> Alphabet:
    """The cell's alphabet with at most ``max_requests`` admissions per sequence.

    ``full`` (1 or 2 requests: one reaches deeper at the same cost, for kills that need
    one request but five operations): every kind of operation. ``pd-decode`` (1 to 3):
    the decode instance of PD disaggregation at the stream level, where requests arrive
    prebuilt (``admit_prebuilt`` with max_new_tokens 2 and the preset's maximum) and every
    iteration field but the EOS position keeps its simplest value (accept length 1, the
    configured rung, no forced retraction, no early processing): few enough operations
    for a third request and a sixth operation, which a row reused under an in-flight
    forward needs (B9 with the release's fence). ``shared`` (1 or 2, radix cells only):
    prompts of one family that share a page of key (the module docstring). With
    ``chunked_prefill_size`` the full
    alphabet admits no prebuilt request (a PD decode instance does not chunk) and a
    prompt of three chunks, and in non-speculative cells or with ``mixed_chunk`` the
    longest prompt, which a small pool caps to 0 new tokens or admission refuses (a
    prefill-only prefill: RP8's witness)."""
    if scope not in MAX_REQUESTS_BY_SCOPE:
        raise ValueError(f"alphabet {scope!r}: not one of {', '.join(MAX_REQUESTS_BY_SCOPE)}")
    most = MAX_REQUESTS_BY_SCOPE[scope]
    if not 1 <= max_requests <= most:
        raise ValueError(f"max_requests {max_requests} outside 1..{most} "
                         f"(the {scope} alphabet)")
    cell, preset = config.cell, config.preset
    longest = preset.max_new_tokens
    prebuilt = [AdmitPrebuilt(p, longest) for p in get_prompt_lens(config)]
    chunk = preset.chunked_prefill_size
    # With chunking, no prebuilt arrivals: a PD decode instance does not prefill, and the
    # two together are the model's composition, not a configuration of the release's.
    admissions: list[Admit | AdmitPrebuilt] = [Admit(1, 2), Admit(1, longest),
                                               *([] if chunk else prebuilt)]
    if chunk:  # a prompt of three chunks: a middle chunk continued, then the last (B18)
        admissions.append(Admit(min(2 * chunk + 1, preset.max_context_len - 1), 2))
    if preset.mixed_chunk or not cell.is_spec:
        # The longest prompt, which the pool caps to 0 new tokens or admission refuses (a
        # one-token stand-in with nothing to generate): RP8's witness, a prefill-only
        # batch, and B19's trigger with mixed chunks.
        admissions.append(Admit(preset.max_context_len - 1, 2))
    admissions = list(dict.fromkeys(admissions))  # the longest and the three-chunk prompt may
    # coincide (2 * chunk + 1 >= max_context_len - 1): one op, not twice the transitions
    rows = preset.max_running_requests
    domains: dict[str, tuple[Hashable, ...]] = {
        "allow_prefill": (True, False),
        "retract": (0, 1),
        "disable_overlap": (False, True) if cell.overlap else (False,),
        "spec_steps": get_rungs(config),
        ACCEPT_LEN: tuple(range(1, config.max_accept_len + 1)),
        EOS_POSITION: (None, *range(max_requests)),
    }
    if scope == PD_DECODE:
        admissions = [AdmitPrebuilt(1, 2), *prebuilt]
        domains = {name: values if name == EOS_POSITION else values[:1]
                   for name, values in domains.items()}
    if scope == SHARED:
        if not cell.radix:
            raise ValueError(f"the {SHARED} alphabet is for radix cells; {cell.name} has no "
                             "prefix tree to share")
        shared = get_shared_prompt_len(config)
        admissions = [Admit(shared, 2, family=0), Admit(shared, longest, family=0)]
        if preset.mixed_chunk or not cell.is_spec:  # RP8's witness, as in the full alphabet
            admissions.append(Admit(preset.max_context_len - 1, 2, family=0))
        kept = SHARED_FIELDS
        domains = {name: values if name in kept else values[:1]
                   for name, values in domains.items()}
        domains[ACCEPT_LEN] = tuple(dict.fromkeys((1, config.max_accept_len)))
    return Alphabet(config, tuple(admissions), max_requests, domains, rows, scope,
                    flush=scope == SHARED, pause=scope != PD_DECODE)


# -- where a field cannot matter -----------------------------------------------------------
# Each predicate restates the condition under which ``Scheduler.run_iteration`` uses the
# field, evaluated when the field is read; False means every value runs the same code
# with the same data, so only the first candidate runs. ``tests/test_exhaust.py`` checks
# that an enumeration with them reaches exactly the states one without them reaches.
def is_prefill_possible(model: Scheduler) -> bool:
    """``get_next_batch_to_run``: ``allow_prefill`` guards ``get_new_batch_prefill``,
    which chooses among waiting requests that are not prebuilt and changes nothing when
    there is none."""
    return any(not req.prebuilt for req in model.waiting_queue)


def is_retract_possible(model: Scheduler) -> bool:
    """A forced retraction runs ``retract_decode`` on any batch it decodes: of one request
    it retracts nothing (it keeps one) but re-estimates the new-token ratio all the same;
    with no request it is not read."""
    batch = model.running_batch
    return batch is not None and len(batch.reqs) >= 1


def is_result_pending(model: Scheduler) -> bool:
    """``run_iteration``: early processing needs a last batch and a queued result, the
    other two conjuncts of the expression that reads ``disable_overlap`` first."""
    return model.last_batch is not None and bool(model.result_queue)


class OracleReadError(RuntimeError):
    """The model read a member of its choices the oracle does not answer: the enumeration
    would not be exhaustive, so the run stops (a crash, never a pass)."""


class ChoiceOracle:
    """Stands in for :class:`IterationChoices` during one iteration and answers each read
    from the decision list: ``decisions[i]`` picks among the distinct answers at the i-th
    branch point (0 past its end). ``taken`` records (picked, number of answers) per
    branch point, for :func:`get_next_decisions`."""

    def __init__(self, alphabet: Alphabet, decisions: list[int]) -> None:
        self._alphabet = alphabet
        self._decisions = decisions
        self._model: Scheduler | None = None
        self._candidates: dict[str, tuple[Hashable, ...]] = {}
        self.taken: list[tuple[int, int]] = []

    def attach(self, model: Scheduler, peek: bool = True) -> None:
        """The model the oracle answers; with ``peek``, fields its state makes irrelevant
        do not branch."""
        self._model = model if peek else None

    def _read(self, name: str, answer: Callable[[Hashable], Hashable],
              matters: Callable[[Scheduler], bool] | None = None) -> Hashable:
        """The answer ``answer(value)`` for the field's value: branch over the distinct
        answers of the remaining candidates, keep those that give the chosen one. Where
        ``matters`` says the model's state makes the value irrelevant, the first
        candidate, without a branch."""
        candidates = self._candidates.get(name, self._alphabet.domains[name])
        if matters is not None and self._model is not None and not matters(self._model):
            candidates = candidates[:1]
        groups: dict[Hashable, list[Hashable]] = {}
        for value in candidates:
            groups.setdefault(answer(value), []).append(value)
        answers = list(groups)
        picked = 0
        if len(answers) > 1:
            index = len(self.taken)
            picked = self._decisions[index] if index < len(self._decisions) else 0
            self.taken.append((picked, len(answers)))
        self._candidates[name] = tuple(groups[answers[picked]])
        return answers[picked]

    def _first(self, name: str) -> Hashable:
        return self._candidates.get(name, self._alphabet.domains[name])[0]

    # -- the members of IterationChoices the model reads ---------------------------------
    @property
    def allow_prefill(self) -> bool:
        return bool(self._read("allow_prefill", lambda value: value, is_prefill_possible))

    @property
    def retract(self) -> int:
        return cast(int, self._read("retract", lambda value: value, is_retract_possible))

    @property
    def disable_overlap(self) -> bool:
        return bool(self._read("disable_overlap", lambda value: value, is_result_pending))

    @property
    def spec_steps(self) -> int:
        config = self._alphabet.config
        self._read("spec_steps", lambda value: config.get_shape(cast(int, value)))
        return cast(int, self._first("spec_steps"))

    @property
    def eos_offset(self) -> int:
        return 0  # EOS ends the accepted run

    def get_accept_len(self, position: int, max_accept_len: int) -> int:
        # IterationChoices clamps into [1, max_accept_len]; every position has the same.
        return cast(int, self._read(ACCEPT_LEN, lambda value: min(max(cast(int, value), 1),
                                                                  max_accept_len)))

    def is_eos(self, position: int) -> bool:
        return bool(self._read(EOS_POSITION, lambda value: value == position))

    def get_eos_index(self, position: int, accept_len: int) -> int | None:
        # IterationChoices.get_eos_index with eos_offset 0: the run's last token.
        return accept_len - 1 if self.is_eos(position) else None

    def __getattr__(self, name: str) -> object:
        raise OracleReadError(f"the model read IterationChoices.{name}, which the exhaustive "
                              "tier's oracle does not answer (harness/exhaust/alphabet.py)")

    # -- the replayable op ----------------------------------------------------------------
    def get_choices(self) -> IterationChoices:
        """The concrete choices of this leaf: each field's first remaining candidate."""
        eos = self._first(EOS_POSITION)
        return IterationChoices(
            allow_prefill=bool(self._first("allow_prefill")),
            retract=cast(int, self._first("retract")),
            accept_lens=(cast(int, self._first(ACCEPT_LEN)),) * self._alphabet.rows,
            eos_positions=frozenset() if eos is None else frozenset({cast(int, eos)}),
            disable_overlap=bool(self._first("disable_overlap")),
            spec_steps=cast(int, self._first("spec_steps")),
            eos_offset=0,
        )

    def as_choices(self) -> IterationChoices:
        """This oracle, typed as what the model's ``run_iteration`` takes."""
        return cast(IterationChoices, self)


def get_next_decisions(taken: list[tuple[int, int]]) -> list[int] | None:
    """The next leaf of the branch-point tree after the one ``taken`` describes
    (depth-first, last branch point first), or None when every leaf has run."""
    for index in range(len(taken) - 1, -1, -1):
        picked, answers = taken[index]
        if picked + 1 < answers:
            return [p for p, _ in taken[:index]] + [picked + 1]
    return None
