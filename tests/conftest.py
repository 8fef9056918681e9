"""Shared set-up: failing scripts go to a temporary folder, not the work tree; the project's
pytest plugin.

The plugin (``harness/pytest_plugin.py``: fixtures, Hypothesis profiles) reaches this suite
the way it reaches an SGLang suite: through the installed package's ``pytest11`` entry
point, which pytest loads before it imports any conftest. Naming it here as well would
register one module twice under two names, which pytest refuses; so it is named here only
when nothing has imported it by now: installed metadata older than the entry point (a
checkout run with ``PYTHONPATH`` against an older install), ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``,
or ``-p no:overlap_spec``. Either way this suite runs with the plugin, loaded once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

PLUGIN = "overlap_spec.harness.pytest_plugin"

pytest_plugins = ["pytester", *([] if PLUGIN in sys.modules else [PLUGIN])]


@pytest.fixture(autouse=True)
def _failure_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERLAP_SPEC_OUT", str(tmp_path / "out"))

