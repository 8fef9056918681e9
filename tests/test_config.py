from __future__ import annotations

import pytest

from overlap_spec.spec.config import (
    MINIMAL,
    REALISTIC,
    Cell,
    ModelConfig,
    SpecMode,
    enumerate_cells,
    get_cell,
    get_departures,
)
from overlap_spec.spec.transitions import compute_admission


def test_every_cell_is_valid_named_once_and_covers_each_switch() -> None:
    cells = enumerate_cells()
    names = [c.name for c in cells]
    assert len(names) == len(set(names)) == 32
    assert {c.spec_mode for c in cells} == set(SpecMode)
    assert {c.overlap for c in cells} == {True, False}
    assert {c.page_size for c in cells} == {1, 4}
    assert any(not c.needs_cpu_seq_lens for c in cells)
    assert any(c.preclaim for c in cells)
    assert [c.name for c in cells if c.rung_reserve] == [
        "ov-p1-v2chain-cpu-honest-rungreserve", "nov-p1-v2chain-cpu-honest-rungreserve"]
    # the overshoot era: every pre-claim overlap cell, and one non-spec cell by name
    assert [c.name for c in cells if c.overshoot and not c.preclaim] == ["ov-p1-none-overshoot"]
    assert all(c.overshoot == c.overlap for c in cells if c.preclaim)
    # the trimmed finish proposal: the release's non-spec and chain overlap cells otherwise
    assert [c.name for c in cells if c.trimmed_finish] == ["ov-p1-none-trimmed",
                                                           "ov-p1-v2chain-cpu-honest-trimmed"]
    # seq_len_cpu_ub (#27979): one cell, the release's chain overlap no-mirror cell otherwise
    assert [c.name for c in cells if c.cpu_ub] == ["ov-p1-v2chain-nocpu-honest-ub"]
    # the early fence proposal: one cell, the release's chain overlap mirror cell otherwise
    assert [c.name for c in cells if c.early_fence] == ["ov-p1-v2chain-cpu-honest-earlyfence"]


def test_trees_on_pages_over_one_are_release_cells() -> None:
    # PR 26972 (2026-06) came after the pre-claim era; no proposal varies a tree.
    assert [c.name for c in enumerate_cells() if c.spec_mode is SpecMode.V2_TREE
            and c.page_size > 1] == ["ov-p4-v2tree-cpu-honest", "ov-p4-v2tree-nocpu-honest",
                                     "nov-p4-v2tree-cpu-honest"]
    cfg = ModelConfig(get_cell("ov-p4-v2tree-cpu-honest"), MINIMAL)
    assert cfg.is_paged_tree and cfg.kv_tokens == MINIMAL.paged_tree_kv_tokens == 96
    assert ModelConfig(get_cell("ov-p4-v2chain-cpu-honest"), MINIMAL).kv_tokens == 32


def _get_paged_tree_a(steps: int, topk: int, draft_tokens: int, page: int) -> int:
    """allocation_sizing.py get_alloc_len_per_decode, page > 1 and topk > 1, written out:
    each branch the pages its steps reach from a partial last page of page - 1 tokens."""
    pages_per_branch = ((page - 1) + steps + page - 1) // page
    return max(pages_per_branch * page * topk, draft_tokens)


def test_irrelevant_switches_take_the_canonical_value() -> None:
    for cell in enumerate_cells():
        if not cell.is_spec:
            assert not cell.preclaim
        if not (cell.is_spec and cell.overlap):
            assert cell.needs_cpu_seq_lens
        if cell.rung_reserve:  # the proposal varies only what the reserve depends on
            assert cell.spec_mode is SpecMode.V2_CHAIN and cell.page_size == 1
            assert cell.needs_cpu_seq_lens and not cell.preclaim
        if cell.overshoot:  # an overlap era
            assert cell.overlap and not cell.skips_finishing_decode


def test_get_cell_names_the_valid_cells_on_error() -> None:
    with pytest.raises(KeyError, match="valid cells"):
        get_cell("ov-p3-none")
    assert get_cell("ov-p1-none") == Cell(True, 1, SpecMode.NONE, True, False)


@pytest.mark.parametrize("preset", [MINIMAL, REALISTIC])
def test_reserve_and_row_width_follow_the_digest(preset: object) -> None:
    for cell in enumerate_cells():
        cfg = ModelConfig(cell, preset)  # type: ignore[arg-type]
        a = max(cfg.spec_steps * cfg.topk, cfg.draft_tokens) if cell.is_spec else 1
        if cfg.is_paged_tree:
            a = _get_paged_tree_a(cfg.spec_steps, cfg.topk, cfg.draft_tokens, cfg.page_size)
        assert cfg.alloc_len_per_decode == a
        if cell.is_spec:
            # The release (#26354): 2A of the widest rung at every rung, with or without
            # overlap. The rung reserve proposal: lag bound + A of the rung (2A at the
            # widest rung under overlap, A without). B16: 2A of the rung.
            for steps in range(1, cfg.spec_steps + 1):
                shape = cfg.get_shape(steps)
                reserve = cfg.get_decode_reserve(shape)
                lag = cfg.draft_tokens if cell.overlap else 0
                if cell.rung_reserve:
                    assert reserve == lag + shape.alloc_len_per_decode
                else:
                    assert reserve == 2 * a >= lag + shape.alloc_len_per_decode
                assert cfg.get_decode_reserve(shape, frozenset({"B16"})) == \
                    2 * shape.alloc_len_per_decode
        # get_req_to_token_extra_context_len: 4 (+ D_tok with speculation), widened to
        # 2A + page - 1 (#26972); the release widens on pages > 1 only (B23).
        extra = 4 + (cfg.draft_tokens if cell.is_spec else 0)
        widened = max(extra, 2 * a + cfg.page_size - 1) if cell.is_spec else extra
        assert cfg.row_width == cfg.preset.max_context_len + widened
        release = widened if cfg.page_size > 1 else extra
        assert cfg.get_row_width(frozenset({"B23"})) == cfg.preset.max_context_len + release
        if cell.spec_mode is SpecMode.V2_CHAIN:
            assert cfg.draft_tokens == cfg.spec_steps + 1 and cfg.topk == 1
        # One request alone always fits the pool (the retraction loop may keep one): the
        # admission caps its output so that prompt + output + the reserve stay inside.
        for prompt in range(1, cfg.preset.max_context_len):
            capped, refused = compute_admission(prompt, cfg.preset.max_new_tokens,
                                                cfg.preset.max_context_len,
                                                cfg.kv_tokens, cfg.page_size)
            longest = (1 if refused else prompt) + max(capped, 1)
            worst = -(-(longest - 1 + (2 * a if cell.is_spec else 1)) // cfg.page_size)
            assert worst * cfg.page_size <= cfg.kv_tokens, (cfg.name, prompt)


# Written out from the release's formula (minimal: context 24; realistic: 256); the
# release's own row is the model's with B23 (no widening on page 1).
@pytest.mark.parametrize(("cell", "preset", "width", "release"), [
    ("ov-p1-none", MINIMAL, 28, 28),
    ("ov-p1-v2chain-cpu-honest", MINIMAL, 32, 32),  # 4 + D_tok 4 = 2A 8
    ("ov-p4-v2chain-cpu-honest", MINIMAL, 35, 35),  # 2A 8 + page 4 - 1
    ("ov-p1-v2tree-cpu-honest", REALISTIC, 280, 268),  # 2A 24; the release: 4 + D_tok 8 (U7)
    ("ov-p4-v2tree-cpu-honest", MINIMAL, 59, 59),  # 2A 32 (A: 1 page x 4 x topk 2) + 3
    ("ov-p4-v2tree-cpu-honest", REALISTIC, 323, 323),  # 2A 64 (A: 2 pages x 4 x topk 4) + 3
])
def test_the_row_width_is_the_releases(cell: str, preset: object, width: int,
                                       release: int) -> None:
    config = ModelConfig(get_cell(cell), preset)  # type: ignore[arg-type]
    assert config.row_width == width
    assert config.get_row_width(frozenset({"B23"})) == release


def test_cells_switches_names_each_era_and_proposal(capsys: pytest.CaptureFixture[str]) -> None:
    from overlap_spec.harness.cli import main

    assert main(["cells", "--switches"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:-1]}
    assert list(rows) == [c.name for c in enumerate_cells()]
    for cell in enumerate_cells():
        line = rows[cell.name]
        assert ("PR 28754" in line) == cell.preclaim
        assert ("task #486" in line) == cell.rung_reserve
        assert ("enable_skip_finishing_decode" in line) == cell.overshoot
        assert ("the early fence" in line) == cell.early_fence
        assert line.endswith("release") == (not get_departures(cell))


# KV3's expected write width, pinned with numbers written out here rather than derived
# (bench/results/mutation-20261125.json: 30 mutants of compute_forward_write_width
# survived every checker, because at the presets' shapes topk * steps never exceeds D_tok
# and no other check reads the width). A shape where it does tells the operands apart.
@pytest.mark.parametrize(("steps", "topk", "draft_tokens", "mode", "width"), [
    (0, 1, 1, "decode", 1),  # no speculation: the token being processed
    (3, 1, 4, "decode", 4),  # the minimal chain: D_tok
    (1, 1, 2, "decode", 2),  # the chain at rung 1 (the adaptive controller's lowest)
    (2, 2, 4, "decode", 4),  # the minimal tree: topk * steps == D_tok
    (3, 4, 8, "decode", 12),  # topk * steps > D_tok: the draft writes more
    (3, 4, 8, "extend", 0),  # a prefill writes nothing from seq_lens on
    (0, 1, 1, "extend", 0),
])
def test_the_forward_write_width_is_the_digests(steps: int, topk: int, draft_tokens: int,
                                               mode: str, width: int) -> None:
    from overlap_spec.spec.config import SpecShape
    from overlap_spec.spec.transitions import compute_forward_write_width
    from overlap_spec.spec.units import TokenCount

    shape = SpecShape(steps, topk, draft_tokens, TokenCount(max(steps * topk, draft_tokens)))
    assert compute_forward_write_width(shape, mode) == width


# The non-spec decode's page need, written out (the last spec mutant standing in
# bench/results/mutation-20261125.json was `seq_len & page_size == 0`): a decode needs a
# new page exactly when its new column starts one.
@pytest.mark.parametrize(("seq_len", "page_size", "pages"), [
    (1, 1, 1), (3, 1, 1), (4, 4, 1), (5, 4, 0), (6, 4, 0), (7, 4, 0), (8, 4, 1), (12, 4, 1)])
def test_a_non_spec_decode_needs_a_page_when_its_column_starts_one(
        seq_len: int, page_size: int, pages: int) -> None:
    from overlap_spec.spec.transitions import compute_ns_decode_pages_needed

    assert compute_ns_decode_pages_needed(seq_len, page_size) == pages
