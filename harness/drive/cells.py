"""The one cell selector and the one default seed every command shares."""

from __future__ import annotations

import fnmatch

from overlap_spec.spec.config import PRESETS, Cell, ModelConfig, enumerate_cells

# The seed every tier runs under unless told otherwise; printed with every failure.
DEFAULT_SEED = 20261122


class UsageError(ValueError):
    """Bad input to a command: ``overlap-spec`` prints this one line and exits 2."""


class NoCellMatches(UsageError):
    """A cell pattern list that names no cell: a usage error, never an empty run."""


def select_cells(patterns: str | None) -> list[Cell]:
    """The cells whose names match any of the comma-separated globs (all when None)."""
    cells = list(enumerate_cells())
    if not patterns:
        return cells
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    chosen = [c for c in cells if any(fnmatch.fnmatch(c.name, p) for p in wanted)]
    if not chosen:
        raise NoCellMatches(f"no cell matches {patterns!r} (see 'overlap-spec cells')")
    return chosen


def select_configs(patterns: str | None, preset: str) -> list[ModelConfig]:
    """The selected cells under one preset, or under every preset for ``"all"``; no match
    is a :class:`NoCellMatches` (a usage error: exit 2, one line, before anything runs)."""
    presets = list(PRESETS.values()) if preset == "all" else [PRESETS[preset]]
    cells = select_cells(patterns)
    return [ModelConfig(cell, p) for p in presets for cell in cells]
