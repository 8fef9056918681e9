"""The default run reaches every mechanism of the model (harness.drive.mechanisms): check's
default run counts, per mechanism, the operations that exercised it, and none is zero; the
counts say what happened (the preset's own sizes reach none of the size-dependent ones);
each recogniser fires on a hand-written script and stays silent on one without its
mechanism; the default run's size variants, their budgets and the serving-default cells."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from overlap_spec.harness.check import run_hypothesis_cells
from overlap_spec.harness.cli import main
from overlap_spec.harness.drive.cells import (
    DEFAULT_SEED,
    get_budget_shares,
    get_release_twin,
    get_size_variants,
    get_upstream_config,
    get_upstream_shares,
    is_serving_default,
    make_preset,
    select_configs,
)
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.mechanisms import MECHANISMS
from overlap_spec.harness.drive.script import (
    Abort,
    Admit,
    AdmitPrebuilt,
    Continue,
    Flush,
    Iterate,
    Op,
    PauseRetract,
    apply_op,
    get_factory,
)
from overlap_spec.harness.drive.stateful import get_profile
from overlap_spec.harness.report import get_mechanism_counts
from overlap_spec.spec.config import ModelConfig, enumerate_cells, enumerate_radix_cells, get_cell
from overlap_spec.spec.state import IterationChoices

SIZE_DEPENDENT = {"chunked-prefill", "chunk-continued", "chunked-abort", "mixed-chunk",
                  "spec-mixed-tail", "oom-abort"}


@pytest.mark.slow
def test_check_default_run_reaches_every_mechanism(tmp_path: Path) -> None:
    """The issue's test: the Hypothesis tier of ``check``'s default run (every cell with
    its size variants, and the radix cells; profile ci, the default seed) counts, for each
    mechanism, the operations that exercised it; a zero fails. A new mechanism joins
    MECHANISMS and is required here at once. CI gives it the report of its own
    ``./dev check --json``
    (``OVERLAP_SPEC_CHECK_JSON``, ``.ci/run``), checked to be that default run; without
    one it runs the tier itself (about two minutes on 2 cores)."""
    configs = select_configs(None, "minimal", None, variants=True, with_radix=True)
    given = os.environ.get("OVERLAP_SPEC_CHECK_JSON")
    if given:
        document = json.loads(Path(given).read_text())
        assert document["seed"] == DEFAULT_SEED and document["profile"] == "ci"
        assert document["cells"] == [c.name for c in configs], "not check's default run"
        assert document["tiers"]["hypothesis"]["verdict"] == "pass"
        counts = document["mechanisms"]
    else:
        results = run_hypothesis_cells(configs, get_profile("ci"), DEFAULT_SEED,
                                       frozenset(), tmp_path, jobs=2, quiet=True)
        assert all(r.ok for r in results), [r.config.name for r in results if not r.ok]
        counts = get_mechanism_counts(results)
    assert set(counts) == {m.id for m in MECHANISMS}
    assert not [m for m, n in counts.items() if n == 0], counts


def test_the_preset_sizes_alone_reach_no_size_dependent_mechanism(tmp_path: Path) -> None:
    """The counts depend on what ran: the same search at the preset's own sizes never
    chunks, mixes or runs out of memory (so a zero there is what the variants are for)."""
    configs = [ModelConfig(get_cell(name), make_preset("minimal", {}))
               for name in ("ov-p1-none", "ov-p1-v2chain-cpu-honest", "ov-p1-v2tree-cpu-honest")]
    results = run_hypothesis_cells(configs, get_profile("quick"), DEFAULT_SEED, frozenset(),
                                   tmp_path, jobs=1, quiet=True)
    counts = get_mechanism_counts(results)
    assert {m for m in SIZE_DEPENDENT if counts[m]} == set()
    assert counts["retraction"] and counts["pd-prebuilt"] and counts["stale-result"]


def _run(cell: str, sizes: dict[str, int], ops: list[Op]) -> dict[str, int]:
    config = ModelConfig(get_cell(cell), make_preset("minimal", sizes))
    checker = InvariantChecker(config)
    model = get_factory("reference")(config, frozenset(), checker)
    admitted: list[int] = []
    for index, op in enumerate(ops):
        model.set_step_index(index)
        apply_op(model, op, admitted)  # type: ignore[arg-type]
    assert checker.mechanisms is not None
    return checker.mechanisms.get_counts()


STEP = Iterate(IterationChoices())
CHUNKED = {"chunked_prefill_size": 4}


@pytest.mark.parametrize(("mechanism", "cell", "sizes", "ops", "without"), [
    ("chunked-prefill", "ov-p1-none", CHUNKED, [Admit(10, 3), STEP], [Admit(3, 3), STEP]),
    ("chunk-continued", "ov-p1-none", CHUNKED, [Admit(10, 3), STEP, STEP],
     [Admit(4, 3), STEP, STEP]),
    ("chunked-abort", "ov-p1-none", CHUNKED, [Admit(10, 3), STEP, Abort(0), STEP, STEP],
     [Admit(3, 3), STEP, Abort(0), STEP, STEP]),
    ("mixed-chunk", "ov-p1-none", {**CHUNKED, "mixed_chunk": 1},
     [Admit(2, 6), STEP, STEP, Admit(10, 3), STEP, STEP],
     [Admit(2, 6), STEP, STEP, STEP, STEP]),
    ("spec-mixed-tail", "ov-p1-v2chain-cpu-honest", {**CHUNKED, "mixed_chunk": 1},
     [Admit(2, 6), STEP, STEP, Admit(10, 3), STEP, STEP],
     [Admit(2, 6), STEP, STEP, STEP, STEP]),
    ("retraction", "ov-p1-none", {}, [Admit(2, 6), Admit(2, 6), STEP, STEP,
                                      Iterate(IterationChoices(retract=1)), STEP],
     [Admit(2, 6), Admit(2, 6), STEP, STEP, STEP, STEP]),
    ("oom-abort", "nov-p1-v2chain-cpu-honest", {"kv_tokens": 12},
     [Admit(5, 5), *[STEP] * 6], [Admit(1, 2), *[STEP] * 6]),
    ("pd-prebuilt", "ov-p1-none", {}, [AdmitPrebuilt(3, 4), STEP, STEP],
     [Admit(3, 4), STEP, STEP]),
    ("refused-prompt", "ov-p1-none", {}, [Admit(23, 2), STEP], [Admit(3, 2), STEP]),
    ("stale-result", "ov-p1-none", {}, [Admit(2, 6), STEP, STEP, Abort(0), STEP, STEP],
     [Admit(2, 6), STEP, STEP, STEP, STEP]),
    ("rung-down", "ov-p1-v2chain-cpu-honest", {},
     [Admit(2, 6), STEP, Iterate(IterationChoices(spec_steps=1)), STEP],
     [Admit(2, 6), STEP, STEP, STEP]),
    # The radix cells: a second request of the first one's family (or of another).
    ("prefix-hit", "ov-p1-none-radix", {}, [Admit(4, 2, 0), STEP, STEP, STEP, Admit(4, 2, 0),
                                            STEP],
     [Admit(4, 2, 0), STEP, STEP, STEP, Admit(4, 2, 1), STEP]),
    ("shared-prefix", "ov-p1-none-radix", {}, [Admit(4, 8, 0), STEP, STEP, Admit(4, 8, 0),
                                               STEP, STEP],
     [Admit(4, 8, 0), STEP, STEP, Admit(4, 8, 1), STEP, STEP]),
    ("tree-eviction", "ov-p1-none-radix", {"kv_tokens": 16},
     [Admit(9, 2, 0), STEP, STEP, STEP, Admit(9, 2, 1), STEP, STEP],
     [Admit(9, 2, 0), STEP, STEP, STEP, Admit(2, 2, 1), STEP, STEP]),
    # Without: refused while the request runs, then one on an empty tree.
    ("cache-flush", "ov-p1-none-radix", {}, [Admit(4, 2, 0), STEP, STEP, STEP, STEP, Flush()],
     [Flush(), Admit(4, 2, 0), STEP, Flush(), STEP]),
    # Without: a pause with nothing admitted, or after the only request finished.
    ("pause-retract", "ov-p1-none", {}, [Admit(2, 6), STEP, STEP, PauseRetract(), STEP,
                                         Continue(), STEP],
     [PauseRetract(), Continue(), Admit(2, 1), STEP, STEP, STEP, PauseRetract(), Continue()]),
])
def test_each_recogniser_fires_on_its_mechanism_only(
        mechanism: str, cell: str, sizes: dict[str, int], ops: list[Op],
        without: list[Op]) -> None:
    assert _run(cell, sizes, ops).get(mechanism, 0) > 0
    assert _run(cell, sizes, without).get(mechanism, 0) == 0


def test_admission_stopped_fires_when_the_rows_run_out() -> None:
    ops: list[Op] = [Admit(2, 6), Admit(2, 6), Admit(2, 6), Admit(2, 6), STEP, STEP]
    assert _run("ov-p1-none", {}, ops).get("admission-stopped", 0) > 0
    assert _run("ov-p1-none", {}, [Admit(2, 6), STEP, STEP]).get("admission-stopped", 0) == 0


def test_the_default_run_adds_each_variant_where_the_cell_takes_it() -> None:
    configs = select_configs(None, "minimal", None, variants=True, with_radix=True)
    cells = enumerate_cells()
    assert [c for c in configs if c.preset.name == "minimal" and not c.cell.radix] == [
        ModelConfig(cell, make_preset("minimal", {})) for cell in cells]
    for variant in get_size_variants("minimal"):
        sized = [c.cell for c in configs if c.preset == make_preset("minimal", variant.sizes)
                 and not c.cell.radix]
        assert sized == [cell for cell in cells if variant.applies(cell)], variant.name
        assert sized
    # Every radix cell once, after the others, at the sizes the release serves it with
    # (the upstream tier's: chunked prefill in the serving-default cells).
    radix = [c for c in configs if c.cell.radix]
    assert configs[-len(radix):] == radix
    assert radix == [get_upstream_config(cell, "minimal", {}) for cell in enumerate_radix_cells()]
    assert {c.preset.chunked_prefill_size for c in radix} == {0, 4}
    # A release cell and its radix twin hold one cell's budget: half at the release cell's
    # own sizes, the rest split among its variants and its radix twin; every cell's shares
    # add to one.
    shares = get_budget_shares(configs)
    for cell in cells:
        together = [(c, s) for c, s in zip(configs, shares, strict=True)
                    if get_release_twin(c.cell) == cell]
        assert sum(s for _, s in together) == pytest.approx(1.0), cell.name
        own = [s for c, s in together if c == ModelConfig(cell, make_preset("minimal", {}))]
        assert own == ([0.5] if len(together) > 1 else [1.0]), cell.name
    twin = dict(zip([c.name for c in configs], shares, strict=True))
    assert twin["ov-p1-none-radix@minimal[chunked_prefill_size=4]"] == pytest.approx(0.5 / 3)
    assert twin["ov-p1-none@minimal[chunked_prefill_size=4]"] == pytest.approx(0.5 / 3)
    # --sizes (one size set): a release cell and its radix twin split the cell's budget,
    # every other cell runs whole.
    sized = select_configs(None, "minimal", {"kv_tokens": 16}, variants=True,
                           with_radix=True)
    by_name = dict(zip([c.cell.name for c in sized], get_budget_shares(sized), strict=True))
    for cell in cells:
        paired = replace(cell, radix=True) in enumerate_radix_cells()
        assert by_name[cell.name] == (0.5 if paired else 1.0), cell.name
    assert all(by_name[cell.name] == 0.5 for cell in enumerate_radix_cells())
    # Without the radix cells (the other commands' selection) nothing changes.
    alone = select_configs(None, "minimal", {"kv_tokens": 16}, variants=True)
    assert set(get_budget_shares(alone)) == {1.0}


def test_the_upstream_tier_splits_a_cell_between_its_release_and_radix_twins() -> None:
    """check's upstream tier drives every cell and every radix cell; a release cell and its
    radix twin split one cell's sequences, a cell without its twin runs them all."""
    names = ["ov-p1-none", "ov-p1-none-radix", "nov-p4-v2chain-cpu-honest",
             "nov-p4-v2chain-cpu-honest-radix", "ov-p1-v2tree-cpu-honest",
             "ov-p1-v2chain-cpu-preclaim"]
    shares = get_upstream_shares([get_cell(n) for n in names], "minimal", {})
    assert shares == [0.5, 0.5, 0.5, 0.5, 1.0, 1.0]
    # The cell server hands each cell's process its share (the tier's --share).
    from argparse import Namespace

    from overlap_spec.harness.conformance.server import _cell_argv, get_shares

    args = Namespace(out=Path("out"), seed=1, profile="ci", preset="minimal", sizes="",
                     sglang_src=None)
    args.shares = get_shares(names, args)
    assert _cell_argv("ov-p1-none-radix", args)[-2:] == ["--share", "0.5"]
    assert "--share" not in _cell_argv("ov-p1-v2tree-cpu-honest", args)


def test_the_upstream_tier_chunks_the_serving_default_cells_only() -> None:
    serving = [cell for cell in enumerate_cells() if is_serving_default(cell)]
    assert {c.name for c in serving} >= {"ov-p1-none", "ov-p1-v2chain-cpu-honest"}
    for cell in enumerate_cells():
        config = get_upstream_config(cell, "minimal", {})
        expected = 4 if cell in serving else 0
        assert config.preset.chunked_prefill_size == expected, cell.name
    # Sizes that say chunked_prefill_size themselves win (0: off).
    off = get_upstream_config(get_cell("ov-p1-none"), "minimal", {"chunked_prefill_size": 0})
    assert off.preset.chunked_prefill_size == 0


def test_cells_marks_the_serving_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cells"]) == 0
    lines = dict(line.split(None, 1) if " " in line else (line, "")
                 for line in capsys.readouterr().out.splitlines())
    for cell in enumerate_cells():
        assert ("serving default" in lines[cell.name]) == is_serving_default(cell), cell.name


def test_review_prints_and_saves_the_mechanism_counts(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "review.json"
    assert main(["review", "-q", "--cells", "ov-p1-none", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "mechanisms reached (operations): chunked-prefill " in out
    assert "default run: 1 cell at the preset's sizes" in out
    document = json.loads(report.read_text())
    assert set(document["mechanisms"]) == {m.id for m in MECHANISMS}
    assert document["mechanisms"]["chunked-prefill"] > 0
    assert document["details"]["ov-p1-none@minimal"]["mechanisms"]["chunked-prefill"] == 0
