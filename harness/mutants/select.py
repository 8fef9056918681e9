"""Which bugs of the catalogue apply where: the cells a mutant is run in (every applicable
cell, or one representative per distinct mechanism), the checkers of the matrix and the
vocabulary of a kill.
"""

from __future__ import annotations

from overlap_spec.harness.catalogue import Bug
from overlap_spec.spec.config import Cell, enumerate_cells, enumerate_radix_cells

KILLED, SURVIVED, NOT_APPLICABLE = "killed", "survived", "n/a"
# A violation, but of no invariant the catalogue lists for the bug: not a kill (the
# checker caught something else, or the bug's mechanism is not the one modelled).
OTHER_ID = "other-id"
CHECKERS = ("hypothesis", "gpu_impl", "z3")
NO_GPU_PATH = "gpu_impl has no code path for this bug"


def get_gpu_unobservable_reason(bug_id: str, cell: Cell) -> str | None:
    """Cells where a bug applies but leaves nothing the differential run can see."""
    if bug_id == "B7" and not cell.overlap:
        return ("without overlap run_batch re-applies the forward's new seq_lens to the "
                "ScheduleBatch right after the forward, so the +D_tok never outlives it")
    return None


def get_applicable_cells(bug: Bug, cells: tuple[Cell, ...] | None = None) -> list[Cell]:
    """The cells (among ``cells``) where ``bug`` applies: a radix bug's among the radix
    cells, the others' among the cells without the cache, whose mechanisms do not touch the
    tree (their radix twins run the same code, with the tree beside it)."""
    pool = cells or (enumerate_radix_cells() if bug.radix else enumerate_cells())
    return [c for c in pool if c.radix == bug.radix and bug.applies(c)]


def get_representative_cells(bug: Bug, cells: tuple[Cell, ...] | None = None) -> list[Cell]:
    """The catalogue's representative cells (among ``cells``), else the first applicable
    cell per spec mode."""
    applicable = get_applicable_cells(bug, cells)
    named = [c for c in applicable if c.name in bug.representative_cells]
    if named:
        return named
    chosen: dict[object, Cell] = {}
    for cell in applicable:
        chosen.setdefault(cell.spec_mode, cell)
    return list(chosen.values())
