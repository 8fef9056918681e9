"""Spec-v2 trees (topk > 1) on pages > 1 (PR 26972; docs/upstream-page-trees.md).

Each branch drafts into a page-aligned region of its own, starting at the prefix's partial
last page; the partial page's KV is copied into the other branches' holes. The write set
depends on ``seq_len % page``, the reserve is the release's page-aware ``2A``, and the
``req_to_token`` row is widened to ``2A + page - 1`` (B21 is that widening reverted).
"""

from __future__ import annotations

import pytest

from overlap_spec.harness.drive.script import Admit, Iterate, Script, run_script
from overlap_spec.reference import worker as reference_worker
from overlap_spec.spec.config import MINIMAL, REALISTIC, ModelConfig, SpecShape, get_cell
from overlap_spec.spec.state import IterationChoices
from overlap_spec.spec.transitions import compute_draft_writes, compute_forward_write_width
from overlap_spec.spec.units import TokenCount

MINIMAL_TREE = SpecShape(2, 2, 4, TokenCount(16))  # steps 2, topk 2, D_tok 4, A at page 4
REALISTIC_TREE = SpecShape(3, 4, 8, TokenCount(32))
CELLS = ["ov-p4-v2tree-cpu-honest", "ov-p4-v2tree-nocpu-honest", "nov-p4-v2tree-cpu-honest"]


# The worked example of docs/upstream-page-trees.md section 3, positions relative to s = 8 + lp:
# (branch 0's slots, branch 1's slots, the copies into branch 1's holes, W).
@pytest.mark.parametrize(("lp", "expected"), [
    (0, ([0, 1], [4, 5], [], 6)),
    (1, ([0, 1], [4, 5], [(3, -1)], 6)),
    (2, ([0, 1], [4, 5], [(2, -2), (3, -1)], 6)),
    (3, ([0, 1], [8, 9], [(5, -3), (6, -2), (7, -1)], 10)),  # two pages a branch; 4 is padding
])
def test_the_draft_writes_are_the_releases_worked_example(
        lp: int, expected: tuple[list[int], list[int], list[tuple[int, int]], int]) -> None:
    s = 8 + lp
    slots, copies = compute_draft_writes(s, MINIMAL_TREE, 4)
    branch0, branch1, relative_copies, width = expected
    assert [p - s for p in slots] == branch0 + branch1
    assert [(t - s, src - s) for t, src in copies] == relative_copies
    assert compute_forward_write_width(MINIMAL_TREE, "decode", 4, s) == width


def test_the_write_width_at_the_realistic_shape_and_its_residue_free_bound() -> None:
    assert [compute_forward_write_width(REALISTIC_TREE, "decode", 4, s) for s in range(4)] == [
        15, 15, 27, 27]
    # Without a seq_len: the widest over every residue (what the Z3 model claims).
    assert compute_forward_write_width(REALISTIC_TREE, "decode", 4) == 27
    assert compute_forward_write_width(MINIMAL_TREE, "decode", 4) == 10
    # Page 1 and chains keep #7163's contiguous layout.
    assert compute_draft_writes(5, MINIMAL_TREE, 1) == ([5, 6, 7, 8], [])
    assert compute_draft_writes(5, SpecShape(3, 1, 4, TokenCount(4)), 4) == ([5, 6, 7], [])


@pytest.mark.parametrize("preset", [MINIMAL, REALISTIC])
def test_every_write_lies_in_the_reserve_and_no_copy_reads_past_the_length(preset: object
                                                                           ) -> None:
    cfg = ModelConfig(get_cell("ov-p4-v2tree-cpu-honest"), preset)  # type: ignore[arg-type]
    shape, page, a = cfg.get_shape(), cfg.page_size, cfg.alloc_len_per_decode
    for s in range(1, 3 * page + 1):
        slots, copies = compute_draft_writes(s, shape, page)
        targets = slots + [t for t, _ in copies]
        width = compute_forward_write_width(shape, "decode", page, s)
        assert len(set(targets)) == len(targets), s  # no position written twice
        assert min(targets) == s and width <= a, s
        assert width == max(max(targets) + 1 - s, shape.draft_tokens), s  # the verify's D_tok
        assert all(s - s % page <= src < s for _, src in copies), s


def _spy_residues(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    residues: set[int] = set()
    original = reference_worker.compute_draft_writes

    def spy(seq_len: int, shape: SpecShape, page_size: int) -> object:
        residues.add(seq_len % page_size)
        return original(seq_len, shape, page_size)

    monkeypatch.setattr(reference_worker, "compute_draft_writes", spy)
    return residues


def _decodes(accepts: list[int]) -> list[Iterate]:
    return [Iterate(IterationChoices(accept_lens=(a, 4 - a))) for a in accepts]


# accept (1, 3): the first request gains one token a step, the second three.
SCRIPT = [Admit(1, 8), Admit(3, 8), *_decodes([1] * 10)]


@pytest.mark.parametrize("cell", CELLS)
def test_two_requests_decode_through_every_residue(cell: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    residues = _spy_residues(monkeypatch)
    outcome = run_script(Script(cell, "minimal", list(SCRIPT)))
    assert outcome.violation is None
    assert residues == {0, 1, 2, 3}


@pytest.mark.parametrize("cell", CELLS)
def test_b21_the_row_not_widened_is_caught_by_kv1(cell: str) -> None:
    outcome = run_script(Script(cell, "minimal", list(SCRIPT), faults=("B21",)))
    assert outcome.violation is not None and outcome.violation.invariant_id == "KV1"
    assert "allocated past the row" in str(outcome.violation)


@pytest.mark.parametrize("cell", CELLS)
def test_a_page_blind_a_under_reserves_and_kv3_sees_the_holey_writes(
        cell: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The constructed mutant (never shipped: before PR 26972 the page branch raised): A =
    max(steps * topk, D_tok) = 4 at page 4. The draft of a prompt of 3 (lp = 3) writes s +
    9, past ceil4(committed + 8): KV3. The page-blind width max(steps * topk, D_tok) would
    have passed it; the writes the forward made do not."""
    def page_blind(self: ModelConfig) -> TokenCount:
        return TokenCount(max(self.spec_steps * self.topk, self.draft_tokens))

    monkeypatch.setattr(ModelConfig, "alloc_len_per_decode", property(page_blind))
    outcome = run_script(Script(cell, "minimal", [Admit(3, 8), *_decodes([1, 1, 1])]))
    assert outcome.violation is not None and outcome.violation.invariant_id == "KV3"
