"""Imports go one way: spec <- reference/gpu_impl/proofs/upstream <- harness <- tests
(GUIDE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "spec": {"spec"},
    "reference": {"spec", "reference"},
    "gpu_impl": {"spec", "gpu_impl"},
    "proofs": {"spec", "proofs"},
    # The third implementation: sglang's own scheduler behind the spec's interface.
    "upstream": {"spec", "upstream"},
    "harness": {"spec", "reference", "gpu_impl", "proofs", "upstream", "harness"},
}
PROJECT = set(ALLOWED)


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & PROJECT


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_its_layer_may(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imports(path) - ALLOWED[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_spec_reads_in_one_sitting() -> None:
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "spec").glob("*.py"))
    assert lines < 2000, f"spec/ has {lines} lines"


def test_every_invariant_docstring_states_its_id_claim_and_source() -> None:
    from spec.invariants import INVARIANTS

    for inv in INVARIANTS:
        doc = " ".join((inv.check.__doc__ or "").split())
        assert doc.startswith(f"{inv.id}: "), inv.id
        assert doc.rstrip(".").endswith(")"), f"{inv.id} names no source: {doc}"
