"""Shared fixtures: failing scripts go to a temporary folder, not the work tree."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _failure_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERLAP_SPEC_OUT", str(tmp_path / "out"))
