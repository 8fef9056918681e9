"""gpu_impl's spec trees on pages > 1 (PR 26972): the draft writes the positions of
``compute_draft_writes`` for every ``seq_len % page`` (page-aligned branch slots, the partial
last page's KV copied into the other branches' holes), computed on the device with no host
read; page 1 and chains keep the contiguous draft; B21 (the row not widened) is a gpu_impl
fault the differential catches, and its write faults are counted as the reference counts
them; the differential agrees in the page-tree cells with no race; a draft that writes as
many slots at wrong positions in its own pages (no write fault) diverges at the request's
``kv_contents``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from overlap_spec.gpu_impl.memory import KV_POSITION_STRIDE
from overlap_spec.gpu_impl.scheduler import Scheduler as GpuScheduler
from overlap_spec.gpu_impl.worker import ModelWorker
from overlap_spec.harness.differential.compare import (
    DifferentialPair,
    check_cell_differential,
    run_differential,
)
from overlap_spec.harness.drive.script import Admit, Iterate, Op, Script
from overlap_spec.harness.drive.stateful import get_profile
from overlap_spec.reference.scheduler import Scheduler as ReferenceScheduler
from overlap_spec.spec.config import MINIMAL, REALISTIC, ModelConfig, get_cell
from overlap_spec.spec.state import IterationChoices
from overlap_spec.spec.transitions import compute_draft_writes

SEED = 20261122
PAGE_TREE_CELLS = ["ov-p4-v2tree-cpu-honest", "ov-p4-v2tree-nocpu-honest",
                   "nov-p4-v2tree-cpu-honest"]
GO = IterationChoices(True, accept_lens=(1,))


def config_of(cell: str, preset: Any = MINIMAL) -> ModelConfig:
    return ModelConfig(get_cell(cell), preset)


def run(model: Any, prompts: list[int], iterations: int, max_new_tokens: int) -> None:
    """Admit ``prompts``, then decode with one token accepted a step: each request's
    ``seq_len`` walks through every residue mod the page."""
    for prompt in prompts:
        model.admit(prompt, max_new_tokens)
    for _ in range(iterations):
        model.run_iteration(GO)


Spied = list[tuple[list[int], list[list[int]], list[list[bool]], list[list[int]]]]


def spy_on(monkeypatch: pytest.MonkeyPatch, name: str,
           record: Callable[..., Any]) -> list[Any]:
    calls: list[Any] = []
    original = getattr(ModelWorker, name)

    def spy(self: ModelWorker, *args: Any) -> Any:
        calls.append(record(self, *args))
        return original(self, *args)

    monkeypatch.setattr(ModelWorker, name, spy)
    return calls


@pytest.mark.parametrize("preset", [MINIMAL, REALISTIC], ids=lambda p: p.name)
@pytest.mark.parametrize("cell", PAGE_TREE_CELLS)
def test_the_draft_writes_compute_draft_writes_for_every_residue(
        monkeypatch: pytest.MonkeyPatch, cell: str, preset: Any) -> None:
    config = config_of(cell, preset)
    page, shape = config.page_size, config.get_shape()
    calls: Spied = spy_on(monkeypatch, "_write_kv_at", lambda _, fb, inputs, pos, live, src: (
        fb.seq_lens.tolist(), pos.tolist(), live.tolist(), src.tolist()))
    prompts = [4, 5, 6] if preset is MINIMAL else [8, 9, 10, 11]
    run(GpuScheduler(config), prompts, 6, 8)
    residues = set()
    for seq_lens, positions, live, sources in calls:
        for s, row, mask, source in zip(seq_lens, positions, live, sources, strict=True):
            slots, copies = compute_draft_writes(s, shape, page)
            written = [(p, q) for p, m, q in zip(row, mask, source, strict=True) if m]
            assert [p for p, q in written if q < 0] == slots, (s, written)
            assert [(p, q) for p, q in written if q >= 0] == copies, (s, written)
            residues.add(s % page)
    assert residues == set(range(page)), residues


def test_the_tail_copy_copies_the_partial_pages_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy target gets its source slot's KV (``move_kv_cache``), not the draft's own; the
    draft's slots get the draft's (its request and position). Each source slot is marked
    just before the draft."""
    config = config_of("nov-p4-v2tree-cpu-honest")
    shape, page = config.get_shape(), config.page_size
    model = GpuScheduler(config)
    table, kv = model.rt.req_to_token_pool.req_to_token, model.rt.kv.kv_cache
    checked: list[int] = []
    original = ModelWorker._write_draft_paged_tree

    def marked(self: ModelWorker, fb: Any, inputs: Any) -> torch.Tensor:
        rows, lens, rids = (fb.req_pool_indices.tolist(), fb.seq_lens.tolist(),
                            inputs.rid.tolist())
        plans = [compute_draft_writes(s, shape, page) for s in lens]
        for row, (_, copies) in zip(rows, plans, strict=True):
            for _, source in copies:
                kv[table[row, source]] = 1000 + source
        faults = original(self, fb, inputs)
        for row, rid, (slots, copies) in zip(rows, rids, plans, strict=True):
            assert all(int(kv[table[row, p]]) == rid * KV_POSITION_STRIDE + p for p in slots)
            for target, source in copies:
                assert int(kv[table[row, target]]) == 1000 + source, (target, source)
                checked.append(target)
        return faults

    monkeypatch.setattr(ModelWorker, "_write_draft_paged_tree", marked)
    run(model, [5, 6, 7], 5, 8)
    assert checked


@pytest.mark.parametrize("cell", ["ov-p1-v2tree-cpu-honest", "nov-p1-v2tree-cpu-honest",
                                  "ov-p4-v2chain-cpu-honest", "nov-p4-v2chain-cpu-honest"])
def test_page_1_and_chains_keep_the_contiguous_draft(monkeypatch: pytest.MonkeyPatch,
                                                     cell: str) -> None:
    config = config_of(cell)
    paged = spy_on(monkeypatch, "_write_kv_at", lambda *_: None)
    contiguous = spy_on(monkeypatch, "_write_kv", lambda _, fb, inputs, starts, lens, width: (
        fb.purpose, starts.tolist(), lens.tolist(), width))
    run(GpuScheduler(config), [4, 5, 6], 5, 8)
    assert not paged
    drafts = [call for call in contiguous if call[0] == "verify"][::2]  # draft, then verify
    assert drafts
    shape = config.get_shape()  # GO leaves the rung at its maximum
    for _, starts, lens, width in drafts:
        assert lens == [width] * len(starts)
        for s in starts:
            slots, copies = compute_draft_writes(s, shape, config.page_size)
            assert list(range(s, s + width)) == slots and not copies


# --- B21: the row not widened ------------------------------------------------------------------
def states_after(config: ModelConfig, ref_faults: frozenset[str], gpu_faults: frozenset[str],
                 iterations: int, prompt: int = 5) -> list[tuple[Any, Any]]:
    reference = ReferenceScheduler(config, ref_faults, None)
    gpu = GpuScheduler(config, gpu_faults)
    states = []
    for model in (reference, gpu):
        model.admit(prompt, 8)
    states.append((reference.get_observable_state(), gpu.get_observable_state()))
    for _ in range(iterations):
        for model in (reference, gpu):
            model.run_iteration(GO)
        states.append((reference.get_observable_state(), gpu.get_observable_state()))
    return states


@pytest.mark.parametrize("cell", PAGE_TREE_CELLS)
def test_b21_a_row_not_widened_diverges_from_the_clean_reference(cell: str) -> None:
    """One request, a prompt of 5: its first decode reserves 2A = 32 past its length, to
    ceil_page(5 + 32) = 40 columns; the release's row holds 24 + 35 = 59, #26972 reverted
    24 + 4 + D_tok = 32. gpu_impl's row is cut there, and its draft / verify past column 32
    are write faults."""
    config = config_of(cell)
    assert config.get_row_width(frozenset({"B21"})) == 32 < 40 < config.row_width == 59
    clean = states_after(config, frozenset(), frozenset(), 4)
    assert all(ref == gpu for ref, gpu in clean)
    faulted = states_after(config, frozenset(), frozenset({"B21"}), 4)
    diverged = [(ref, gpu) for ref, gpu in faulted if ref != gpu]
    assert diverged
    ref, gpu = diverged[0]
    assert len(gpu.requests[0].req_to_token) == 32 < len(ref.requests[0].req_to_token) == 40


@pytest.mark.parametrize("cell", PAGE_TREE_CELLS)
def test_b21_write_faults_are_counted_as_the_reference_counts_them(cell: str) -> None:
    """Both with B21: the rows, allocations and KV write faults agree. At the realistic
    shape (topk 4, steps 3, page 4; A = 32) the row is 256 + 67 = 323, cut to 256 + 12 = 268;
    a prompt of 249 decodes through seq_len 251 (lp = 3, two pages a branch), whose last
    branch drafts up to column 279: past the cut row, inside kv_allocated_len (the
    reference's unset entries, gpu_impl's row clamp)."""
    config = config_of(cell, REALISTIC)
    faults = frozenset({"B21"})
    assert config.get_row_width(faults) == 268
    states = states_after(config, faults, faults, 6, prompt=249)
    for ref, gpu in states:
        assert ref == gpu
    assert states[-1][1].kv_write_faults > 0


# --- the differential in the page-tree cells ------------------------------------------------
@pytest.mark.parametrize("cell", PAGE_TREE_CELLS)
def test_gpu_impl_agrees_with_the_reference_in_the_page_tree_cells(cell: str) -> None:
    result = check_cell_differential(config_of(cell), get_profile("quick"), SEED,
                                     max_examples=12, top_up=True)
    assert result.error is None, f"crash: {result.error!r}"
    assert result.failure is None, (
        f"{result.failure.outcome.describe()}\nscript: {result.failure.script.ops}")
    assert result.compared_ops > 0 and result.launches > 0


def test_the_differential_catches_b21() -> None:
    result = check_cell_differential(config_of("ov-p4-v2tree-cpu-honest"), get_profile("quick"),
                                     SEED, frozenset({"B21"}), max_examples=12, shrink=False)
    assert result.error is None, f"crash: {result.error!r}"
    assert result.failure is not None
    divergence = result.failure.outcome.divergence
    assert divergence is not None and divergence.field.endswith("req_to_token"), divergence


# --- what each forward wrote where (issue 43) ----------------------------------------------
def test_a_draft_at_wrong_positions_diverges_at_the_kv_contents(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree's branch regions sized without the partial page (``ceil(steps / page)`` pages
    where ``compute_draft_writes`` takes ``ceil((lp + steps) / page)``): the same number of
    writes, each in the request's own pages below ``kv_allocated_len``, so no write fault,
    but at wrong positions once ``lp + steps`` passes a page. A prompt of 5 at page 4
    decodes one token a step; at seq_len 7 (lp 3) the second branch drafts columns 11 and 12
    instead of 15 and 16 and copies the tail into 8..10 (the verify then overwrites them)
    instead of 12..14, so columns 12..16 differ. Only ``kv_contents`` shows it: the
    differential names it at that decode, with every other field equal, ``kv_write_faults``
    included."""
    config = config_of("ov-p4-v2tree-cpu-honest")
    page, steps = config.page_size, config.get_shape().steps
    original = ModelWorker._write_kv_at

    def misplaced(self: ModelWorker, fb: Any, inputs: Any, positions: torch.Tensor,
                  live: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
        seq_lens = fb.seq_lens[:, None]
        base = seq_lens - seq_lens % page
        span = (seq_lens % page + steps + page - 1) // page * page
        short = (steps + page - 1) // page * page  # the partial page left out
        moved = base + (positions - base) // span * short + (positions - base) % span
        return original(self, fb, inputs, moved, live, sources)

    monkeypatch.setattr(ModelWorker, "_write_kv_at", misplaced)
    ops: list[Op] = [Admit(5, 8), *[Iterate(GO)] * 5]
    outcome = run_differential(Script(config.cell.name, "minimal", ops))
    divergence = outcome.divergence
    assert divergence is not None, outcome.describe()
    assert (divergence.step, divergence.field) == (4, "request r0.kv_contents"), divergence
    ref, gpu = divergence.reference, divergence.gpu_impl
    differing = [c for c, (a, b) in enumerate(zip(ref, gpu, strict=True)) if a != b]
    assert differing == [12, 13, 14, 15, 16], (ref, gpu)  # 11: the last draft's, in both
    assert (ref[12], gpu[12]) == ((0, 4), (0, 12))  # the tail copy's target, a draft slot
    pair = DifferentialPair(config)
    for op in ops[:divergence.step + 1]:
        pair.apply(op)
    assert pair.reference_state is not None
    blind = [replace(state, requests=tuple(replace(r, kv_contents=None)
                                           for r in state.requests))
             for state in (pair.reference_state, pair.gpu.get_observable_state())]
    assert blind[0] == blind[1]  # kv_write_faults, rows and lengths all agree
