"""The one operation distribution: what the checkers draw, in two interpretations.

- :func:`get_strategies`: the Hypothesis strategies the state machine's rules draw from
  (``stateful.py``), so a search shrinks toward small values;
- :func:`generate_random_ops`: the same kind of sequence from a seeded ``random.Random``,
  for the conformance vectors and the trace tests, which need a fixed byte-for-byte
  output from a seed without Hypothesis.

Both bias the draw the same way: full acceptance and the extreme rungs (where the reserve
arithmetic is tight) more often than uniform, early result processing occasionally, and
prompts up to the context length (where admission caps ``max_new_tokens`` and refuses a
prompt too long) about a quarter of the time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Final

from hypothesis import strategies as st

from overlap_spec.harness.drive.script import (
    Abort,
    Admit,
    AdmitPrebuilt,
    Continue,
    Flush,
    Iterate,
    Op,
    PauseRetract,
)
from overlap_spec.spec.config import ModelConfig, Preset, SpecMode
from overlap_spec.spec.state import IterationChoices


@dataclass(frozen=True)
class OpStrategies:
    """What one cell's state machine draws its operations' arguments from."""

    prompt_len: Any
    max_new_tokens: Any
    prebuilt_max_new_tokens: Any
    accept_lens: Any
    eos_positions: Any
    rarely: Any
    spec_steps: Any
    eos_offset: Any
    family: Any  # Admit.family: radix cells share prompts; elsewhere always None


# The families a radix cell's admissions draw: mostly the first two requests' prompts, so
# that prefixes are shared (a request of family 0 shares request 0's prompt), shrinking to
# the request's own.
RADIX_FAMILIES: Final = (None, 0, 0, 1)


def get_prompt_lens(preset: Preset) -> list[int]:
    """The prompt lengths drawn from, with repeats as weights: up to ``max_prompt_len``
    mostly, and up to the context length (where admission caps ``max_new_tokens`` and
    refuses a prompt too long) about a quarter of the time; shrinking goes to 1. A context
    shorter than ``max_prompt_len`` (a size) bounds both."""
    short = list(range(1, min(preset.max_prompt_len, preset.max_context_len - 1) + 1))
    return short * 8 + list(range(preset.max_prompt_len + 1, preset.max_context_len))


def get_strategies(config: ModelConfig, upstream: bool = False) -> OpStrategies:
    """The strategies for ``config``'s cell and preset. The upstream tier draws the
    configured speculative shape only (the release's controller picks its rung)."""
    preset = config.preset
    width = preset.max_running_requests
    max_accept = config.max_accept_len
    max_steps = preset.chain_steps if config.cell.spec_mode is SpecMode.V2_CHAIN else 0
    # Full acceptance and the extreme rungs are where the reserve arithmetic is tight, so
    # they are drawn more often than a uniform draw would: about half the time. Each is
    # one sampled_from (one choice for Hypothesis, not a one_of and its branch), ordered
    # so that shrinking still goes to accept length 1, rung 0 and no EOS.
    accept_len = st.sampled_from([*range(1, max_accept + 1), *[max_accept] * max_accept])
    spec_steps = st.just(0) if upstream else st.sampled_from(
        [0, *range(0, max_steps + 1), *sorted({1, max_steps})] if max_steps else [0])
    # Prompts up to the context length (the admission caps and refuses there), drawn
    # about a quarter of the time; shrinking goes to the short ones.
    return OpStrategies(
        prompt_len=st.sampled_from(get_prompt_lens(preset)),
        max_new_tokens=st.integers(1, preset.max_new_tokens),
        prebuilt_max_new_tokens=st.integers(2, preset.max_new_tokens),
        accept_lens=(st.just((1,) * width) if max_accept == 1
                     else st.tuples(*[accept_len] * width)),
        eos_positions=st.sampled_from([*[frozenset()] * width,
                                       *[frozenset({j}) for j in range(width)]]),
        # Early result processing removes the lag that overlap bugs need; keep it occasional.
        rarely=st.sampled_from([False, False, False, True]),
        spec_steps=spec_steps,
        eos_offset=st.integers(0, max_accept - 1),
        family=st.sampled_from(RADIX_FAMILIES) if config.cell.radix else st.just(None),
    )


def generate_random_ops(config: ModelConfig, rng: random.Random, count: int) -> list[Op]:
    """A random operation sequence drawn like :func:`get_strategies` draws (a fixed seed
    gives fixed bytes: the vectors depend on it)."""
    preset = config.preset
    width = preset.max_running_requests
    top = config.max_accept_len
    steps = preset.chain_steps if config.cell.spec_mode is SpecMode.V2_CHAIN else 0
    prompt_lens = get_prompt_lens(preset)
    ops: list[Op] = []
    admitted = 0
    paused, pauses = False, 0
    for _ in range(count):
        roll = rng.random()
        if paused and roll < 0.3:
            ops.append(Continue())
            paused = False
        elif admitted < 4 and (roll < 0.3 or admitted == 0):
            admitted += 1
            if not preset.chunked_prefill_size and rng.random() < 0.2:
                ops.append(AdmitPrebuilt(rng.choice(prompt_lens),
                                         rng.randint(2, preset.max_new_tokens)))
            else:
                ops.append(Admit(rng.choice(prompt_lens),
                                 rng.randint(1, preset.max_new_tokens),
                                 rng.choice(RADIX_FAMILIES) if config.cell.radix else None))
        elif roll > 0.95:
            ops.append(Abort(rng.randrange(admitted)))
        elif roll > 0.92 and config.cell.radix:  # flush_cache, drawn in the radix cells
            ops.append(Flush())
        elif roll > 0.9 and not pauses:  # pause_generation(mode="retract"), once a script
            ops.append(PauseRetract())
            pauses, paused = 1, rng.random() < 0.5
            if not paused:
                ops.append(Continue())
        else:
            accept = tuple(top if rng.random() < 0.3 else rng.randint(1, top)
                           for _ in range(width))
            eos = frozenset({rng.randrange(width)}) if rng.random() < 0.25 else frozenset()
            ops.append(Iterate(IterationChoices(
                allow_prefill=rng.random() < 0.8, retract=int(rng.random() < 0.1),
                accept_lens=accept, eos_positions=eos, disable_overlap=rng.random() < 0.15,
                spec_steps=rng.choice([0, 0, 1, steps]) if steps else 0,
                eos_offset=rng.randrange(top))))
    return ops
