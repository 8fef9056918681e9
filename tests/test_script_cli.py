"""Scripts round-trip, malformed input is rejected with a clear message, the CLI exits right."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from overlap_spec.harness.cli import main
from overlap_spec.harness.drive.cells import DEFAULT_SEED, select_configs
from overlap_spec.harness.drive.generate import generate_random_ops, get_strategies
from overlap_spec.harness.drive.script import (
    Abort,
    Admit,
    AdmitPrebuilt,
    Flush,
    Iterate,
    Op,
    Script,
    ScriptError,
    check_op_ranges,
    get_op_limits,
    load_script,
    run_script,
    save_script,
    script_from_json,
    script_to_json,
)
from overlap_spec.harness.drive.stateful import MAX_REQUESTS
from overlap_spec.spec.bugs import BUG_IDS
from overlap_spec.spec.config import PRESETS, ModelConfig, enumerate_cells
from overlap_spec.spec.invariants import INVARIANT_IDS
from overlap_spec.spec.state import IterationChoices


def _script(faults: tuple[str, ...] = ()) -> Script:
    ops = [
        Admit(3, 4),
        Iterate(IterationChoices(True, 0, (2, 1, 1), frozenset())),
        Iterate(IterationChoices(True, 0, (3, 1, 1), frozenset({0}))),
        Iterate(IterationChoices(False, 0, (1, 1, 1), frozenset())),
        Abort(0),
        Iterate(IterationChoices(True, 0, (1, 1, 1), frozenset())),
        Flush(),
    ]
    return Script("ov-p1-v2chain-cpu-honest", "minimal", ops, faults, seed=7)


def test_script_round_trips_through_json(tmp_path: Path) -> None:
    script = _script(("B3",))
    assert script_to_json(script_from_json(script_to_json(script))) == script_to_json(script)
    path = save_script(script, tmp_path / "s.json")
    assert script_to_json(load_script(path)) == script_to_json(script)


def test_a_clean_script_runs_clean() -> None:
    assert run_script(_script()).violation is None


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.pop("ops"), "missing field 'ops'"),
    (lambda d: d.update(version=9), "unsupported version 9"),
    (lambda d: d.update(cell="ov-p9-none"), "unknown cell"),
    (lambda d: d.update(preset="huge"), "unknown preset"),
    (lambda d: d.update(faults=["B99"]), "unknown fault IDs"),
    (lambda d: d["ops"].append({"op": "teleport"}), "unknown op 'teleport'"),
    (lambda d: d["ops"][0].pop("prompt_len"), "op 0: missing field 'prompt_len'"),
    (lambda d: d["ops"][1].update(accept_lens=["x"]), "must be a list of integers"),
    (lambda d: d["ops"][0].update(prompt_len=True), "must be an integer"),
])
def test_malformed_scripts_are_rejected_with_the_field(mutate: object, message: str) -> None:
    raw = script_to_json(_script())
    mutate(raw)  # type: ignore[operator]
    with pytest.raises(ScriptError, match=message.replace("(", r"\(").replace("[", r"\[")):
        script_from_json(raw)


def _set(index: int, **fields: object) -> object:
    return lambda d: d["ops"][index].update(fields)


# _script() is in ov-p1-v2chain-cpu-honest@minimal: 3 request rows, prompts up to 5 tokens,
# 8 new tokens, chain rungs 0..3, accept lengths 1..4.
@pytest.mark.parametrize(("mutate", "message"), [
    (_set(0, prompt_len=0), "op 0 (admit): field 'prompt_len' is 0; allowed 1..23"),
    (_set(0, prompt_len=24), "op 0 (admit): field 'prompt_len' is 24; allowed 1..23"),
    (_set(0, max_new_tokens=-1), "field 'max_new_tokens' is -1; allowed 1..8"),
    (_set(0, max_new_tokens=10**9), "field 'max_new_tokens' is 1000000000; allowed 1..8"),
    (_set(0, op="admit_prebuilt", prompt_len=-3),
     "op 0 (admit_prebuilt): field 'prompt_len' is -3"),
    (_set(1, retract=-1), "op 1 (iterate): field 'retract' is -1; allowed 0..3"),
    (_set(1, retract=4), "field 'retract' is 4; allowed 0..3"),
    (_set(1, accept_lens=[0]), "field 'accept_lens' is 0; allowed 1..4"),
    (_set(1, accept_lens=[1, 5]), "field 'accept_lens' is 5; allowed 1..4"),
    (_set(1, accept_lens=[1, 1, 1, 1]), "field 'accept_lens' has 4 entries; allowed at most 3"),
    (_set(2, eos_positions=[3]), "op 2 (iterate): field 'eos_positions' is 3; allowed 0..2"),
    (_set(2, eos_positions=[-1]), "field 'eos_positions' is -1; allowed 0..2"),
    (_set(1, spec_steps=4), "field 'spec_steps' is 4; allowed 0..3"),
    (_set(1, spec_steps=-1), "field 'spec_steps' is -1; allowed 0..3"),
    (_set(1, eos_offset=4), "field 'eos_offset' is 4; allowed 0..3"),
    (_set(4, request=-1), "op 4 (abort): field 'request' is -1; allowed 0..5"),
    (_set(4, request=10**9), "op 4 (abort): field 'request' is 1000000000; allowed 0..5"),
])
def test_out_of_range_ops_are_rejected_with_op_field_and_range(mutate: object,
                                                               message: str) -> None:
    raw = script_to_json(_script())
    mutate(raw)  # type: ignore[operator]
    with pytest.raises(ScriptError, match=re.escape(message)):
        script_from_json(raw)


@pytest.mark.parametrize(("sizes", "message"), [
    ([16], "field 'sizes' must be an object"),
    ({"pool": 16}, "unknown size 'pool'; settable: kv_tokens, max_running_requests, "
                   "paged_tree_kv_tokens, chain_steps"),
    ({"kv_tokens": 0}, "size 'kv_tokens' is 0; allowed 1..8192"),
    ({"kv_tokens": 10**9}, "size 'kv_tokens' is 1000000000; allowed 1..8192"),
    ({"kv_tokens": "16"}, "size 'kv_tokens' is '16'; allowed 1..8192"),
    ({"chain_steps": 0}, "size 'chain_steps' is 0; allowed 1..7"),
    ({"max_running_requests": True}, "size 'max_running_requests' is True"),
])
def test_sizes_out_of_range_are_rejected_with_the_field(sizes: object, message: str) -> None:
    raw = script_to_json(_script())
    raw["sizes"] = sizes
    with pytest.raises(ScriptError, match=re.escape(message)):
        script_from_json(raw)


def test_a_pool_of_part_pages_is_rejected_for_the_cell() -> None:
    raw = script_to_json(_script())
    raw.update(cell="ov-p4-none", sizes={"kv_tokens": 18})
    raw["ops"] = raw["ops"][:1]
    with pytest.raises(ScriptError, match="needs whole pages of 4 tokens"):
        script_from_json(raw)


def test_sizes_set_the_pool_the_rows_and_the_chain(tmp_path: Path) -> None:
    """A script's sizes reach the configuration it runs, its limits and its saved form;
    the limits that follow them bite (a fourth row with max_running_requests=2)."""
    script = _script()
    script.sizes = {"kv_tokens": 12, "chain_steps": 2, "max_running_requests": 2}
    config = script.get_config()
    assert (config.preset.kv_tokens, config.spec_steps, config.preset.max_running_requests,
            config.draft_tokens) == (12, 2, 2, 3)
    assert config.name == ("ov-p1-v2chain-cpu-honest@minimal[chain_steps=2,kv_tokens=12,"
                           "max_running_requests=2]")
    assert get_op_limits(config).accept_len == (1, 3)
    raw = script_to_json(script)
    assert raw["sizes"] == {"chain_steps": 2, "kv_tokens": 12, "max_running_requests": 2}
    with pytest.raises(ScriptError, match=re.escape("field 'accept_lens' has 3 entries; "
                                                    "allowed at most 2")):
        script_from_json(raw)
    raw["ops"] = [op for op in raw["ops"] if op["op"] != "iterate"] + [
        {"op": "iterate", "allow_prefill": True, "retract": 0, "accept_lens": [3, 1],
         "eos_positions": []}]
    loaded = script_from_json(raw)
    assert loaded.sizes == script.sizes and loaded.get_config() == config
    assert Script.for_config(config).sizes == script.sizes  # a run's saved script keeps them
    assert run_script(loaded).violation is None
    # The same sizes as the preset's are no override: the script stays as it was.
    same = script_to_json(_script())
    same["sizes"] = {"kv_tokens": PRESETS["minimal"].kv_tokens}
    assert script_from_json(same).get_config() == _script().get_config()


def test_review_runs_at_the_sizes_given(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["review", "--cells", "ov-p1-none", "--sizes", "kv_tokens=20", "-q",
                 "--jobs", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "sizes kv_tokens=20" in out.splitlines()[0] and "1/1 cells clean" in out, out
    assert main(["review", "--cells", "ov-p4-none", "--sizes", "kv_tokens=21", "-q"]) == 2


def test_the_limits_follow_the_cell_and_the_preset() -> None:
    raw = script_to_json(_script())
    raw["cell"] = "ov-p1-none"  # no speculation: one token per step
    with pytest.raises(ScriptError, match=re.escape("field 'accept_lens' is 2; allowed 1..1")):
        script_from_json(raw)
    raw = script_to_json(_script())
    raw["preset"] = "realistic"
    raw["ops"][0]["prompt_len"] = 64
    assert script_from_json(raw).ops[0] == Admit(64, 4)


@pytest.mark.parametrize("config", [ModelConfig(cell, preset) for cell in enumerate_cells()
                                    for preset in PRESETS.values()], ids=str)
def test_the_random_generator_stays_within_the_limits(config: ModelConfig) -> None:
    """What the checkers draw is what a script may hold (harness.drive.generate)."""
    for seed in range(5):
        check_op_ranges(config, generate_random_ops(config, random.Random(seed), 40))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), config=st.sampled_from(
    [ModelConfig(cell, preset) for cell in enumerate_cells() for preset in PRESETS.values()]))
def test_the_state_machines_draws_stay_within_the_limits(data: st.DataObject,
                                                         config: ModelConfig) -> None:
    draw = get_strategies(config)
    ops: list[Op] = [
        Admit(data.draw(draw.prompt_len), data.draw(draw.max_new_tokens)),
        AdmitPrebuilt(data.draw(draw.prompt_len), data.draw(draw.prebuilt_max_new_tokens)),
        Iterate(IterationChoices(True, data.draw(st.integers(0, 1)),
                                 tuple(data.draw(draw.accept_lens)),
                                 data.draw(draw.eos_positions), False,
                                 data.draw(draw.spec_steps), data.draw(draw.eos_offset))),
        Abort(data.draw(st.integers(0, MAX_REQUESTS - 1))),
    ]
    check_op_ranges(config, ops)


def test_replay_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clean = save_script(_script(), tmp_path / "clean.json")
    assert main(["replay", str(clean)]) == 0
    assert "no violation" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["replay", str(bad)]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "missing.json")]) == 2


def test_replay_of_a_failing_script_exits_one(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    ops = [Admit(2, 3), Iterate(IterationChoices(True, 0, (1,), frozenset())),
           Iterate(IterationChoices(True, 0, (1,), frozenset()))]
    path = save_script(Script("ov-p1-none", "minimal", ops, ("B8",)), tmp_path / "f.json")
    assert main(["replay", str(path)]) == 1
    assert "ST2 violated" in capsys.readouterr().out


# -- check's report end to end (slow) --------------------------------------------------------
# The two tests below run `check` itself, about a minute of CPU together. CI runs
# `./dev check --json ci-check.json` (every tier, every cell, its size variants) as a step of
# its own; .ci/run hands that report to these tests (``OVERLAP_SPEC_CHECK_JSON``, as to
# tests/test_mechanisms.py), which then assert the same of CI's full run. Without one they
# run the smaller checks below. The default tier keeps check's failing path end to end
# (test_check_with_a_fault_fails_and_reports_fail) and each tier's own tests.
def _get_ci_check_report() -> dict[str, Any] | None:
    """CI's own `check --json` report (.ci/run), checked to be the default run, or None."""
    given = os.environ.get("OVERLAP_SPEC_CHECK_JSON")
    if not given:
        return None
    document: dict[str, Any] = json.loads(Path(given).read_text())
    assert document["seed"] == DEFAULT_SEED and document["profile"] == "ci"
    assert document["cells"] == [c.name for c in select_configs(None, "minimal", None,
                                                                  variants=True,
                                                                  with_radix=True)]
    return document


def _assert_every_id_in_every_cell(doc: dict[str, Any]) -> None:
    assert doc["tiers"]["hypothesis"]["verdict"] == "pass"
    assert doc["tiers"]["mutants"]["verdict"] == "pass"
    assert doc["version"] == 1 and doc["ok"] is True and isinstance(doc["elapsed_s"], float)
    # Every registered invariant (spec/invariants/); tests/test_invariants_can_fail.py's
    # PERTURB is the hand-written list that fails when one goes missing.
    assert sorted(doc["invariants"]) == sorted(INVARIANT_IDS)
    for verdicts in doc["invariants"].values():
        assert set(verdicts) == set(doc["cells"])
        assert set(verdicts.values()) <= {"pass", "n/a"}
    assert doc["invariants"]["FM1"]["ov-p1-none@minimal"] == "n/a"
    assert doc["invariants"]["KV10"]["nov-p1-v2chain-cpu-preclaim@minimal"] == "pass"
    # The mutant matrix ran over the selected cells: every bug has an entry.
    assert sorted(doc["mutants"], key=lambda b: int(b[1:])) == list(BUG_IDS)
    verdicts = {b: m["hypothesis"]["verdict"] for b, m in doc["mutants"].items()}
    assert set(verdicts.values()) <= {"killed", "n/a"}
    assert verdicts["B8"] == "killed"
    for entry in doc["details"].values():  # exercised, or n/a at these sizes with a reason
        assert all(n > 0 or inv in entry["witnesses"]["not_applicable"]
                   for inv, n in entry["exercised"].items())


@pytest.mark.slow
def test_check_json_has_every_id_in_every_cell(tmp_path: Path) -> None:
    ci = _get_ci_check_report()
    if ci is not None:
        _assert_every_id_in_every_cell(ci)
        # Every cell has a representative: no bug is left n/a by the default run.
        assert {m["hypothesis"]["verdict"] for m in ci["mutants"].values()} == {"killed"}
        return
    out = tmp_path / "r.json"
    # The gpu_impl, Z3 and upstream tiers have their own tests; here they are skipped for time.
    # Two jobs whatever the machine: the Hypothesis and mutant tiers' tasks go through
    # spawned workers (pickled there and back), as they do for a user.
    code = main(["check", "-q", "--cells", "ov-p1-none,nov-p1-v2chain-cpu-preclaim",
                 "--profile", "quick", "--no-differential", "--no-proofs", "--no-upstream",
                 "-j", "2", "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    _assert_every_id_in_every_cell(doc)
    assert doc["differential"] == {"status": "skipped", "reason": "--no-differential"}
    assert doc["proofs"] == {"status": "skipped", "reason": "--no-proofs"}
    assert {doc["tiers"][t]["verdict"] for t in ("differential", "proofs")} == {"skipped"}
    # Each cell at its preset's sizes, then the default run's size variants it takes.
    assert doc["cells"] == [c.name for c in select_configs(
        "ov-p1-none,nov-p1-v2chain-cpu-preclaim", "minimal", None, variants=True,
        with_radix=True)]
    assert doc["cells"][0] == "ov-p1-none@minimal" and len(doc["cells"]) == 6
    assert doc["mutants"]["B5"]["hypothesis"]["verdict"] == "n/a"  # no cell of B5's here


def test_check_with_a_fault_fails_and_reports_fail(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    code = main(["check", "-q", "--cells", "ov-p1-none", "--faults", "B8", "--json", str(out),
                 "--out", str(tmp_path)])
    assert code == 1
    doc = json.loads(out.read_text())
    assert doc["ok"] is False and doc["tiers"]["hypothesis"]["verdict"] == "fail"
    assert doc["tiers"]["mutants"]["reason"].startswith("--faults")
    assert doc["invariants"]["ST2"]["ov-p1-none@minimal"] == "fail"
    assert doc["details"]["ov-p1-none@minimal"]["trace"] == "violation"
    assert "overlap-spec replay" in doc["details"]["ov-p1-none@minimal"]["replay"]


def test_usage_errors_exit_two(capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["check", "--faults", "B99"]) == 2
    capsys.readouterr()
    for command in (["check", "--cells", "nothing-matches"], ["diff", "--cells", "nope"],
                    ["mutants", "--cells", "nope"], ["prove", "--cells", "nope"]):
        assert main(command) == 2, command
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no cell matches" in err[0], (command, err)
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "bogus")
    assert main(["check", "--cells", "ov-p1-none"]) == 2
    err = capsys.readouterr().err
    assert "unknown profile 'bogus' (from HYPOTHESIS_PROFILE)" in err and "Traceback" not in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import overlap_spec

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"overlap-spec {overlap_spec.__version__}"


def test_help_documents_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for word in ("check", "replay", "cells", "invariants", "Exit codes"):
        assert word in text


@pytest.mark.slow
def test_check_runs_the_differential_and_proof_tiers(tmp_path: Path) -> None:
    cell_name = "ov-p1-v2chain-cpu-honest@minimal"
    doc = _get_ci_check_report()
    if doc is None:
        out = tmp_path / "r.json"
        # The upstream tier inside check is the upstream test tier's
        # (tests/test_upstream_tier.py).
        code = main(["check", "-q", "--cells", "ov-p1-v2chain-cpu-honest", "--no-mutants",
                     "--no-upstream", "--json", str(out)])
        assert code == 0
        doc = json.loads(out.read_text())
    assert doc["ok"] is True
    cell = doc["differential"]["cells"][cell_name]
    assert doc["differential"]["status"] == "pass" and cell["verdict"] == "pass"
    assert cell["examples"] > 0
    assert doc["proofs"]["ok"] is True and doc["proofs"]["counts"]["unknown"] == 0


def test_only_a_watching_detector_says_no_race() -> None:
    from overlap_spec.harness.differential.compare import DifferentialOutcome
    from overlap_spec.harness.differential.tier import describe_race_check

    assert describe_race_check(torch.device("cpu")).startswith("no race")
    assert describe_race_check(torch.device("cuda")).startswith("races not checked")
    assert "sanitizer" in describe_race_check(torch.device("cuda"), cuda_sanitizer=True)
    assert DifferentialOutcome(3, races_checked=False).describe().endswith("races not checked")
    assert DifferentialOutcome(3).describe().endswith("no race")


def test_a_differential_that_compared_too_little_is_vacuous_not_a_pass() -> None:
    from overlap_spec.harness.differential.compare import (
        MIN_COMPARED_OPS,
        MIN_LAUNCHES,
        DifferentialResult,
    )
    from overlap_spec.harness.differential.tier import differential_tier_report
    from overlap_spec.harness.verdict import Verdict
    from overlap_spec.spec.config import PRESETS, ModelConfig, get_cell

    config = ModelConfig(get_cell("ov-p1-none"), PRESETS["minimal"])
    enough = DifferentialResult(config, frozenset(), 1, 1.0, examples=10,
                                compared_ops=MIN_COMPARED_OPS, launches=MIN_LAUNCHES)
    thin = DifferentialResult(config, frozenset(), 1, 1.0, examples=1, compared_ops=3,
                              launches=1)
    assert differential_tier_report([enough]).verdict is Verdict.PASS
    report = differential_tier_report([enough, thin])
    assert report.verdict is Verdict.VACUOUS and report.verdict.fails_run
    cell = report.section["differential"]["cells"]["ov-p1-none@minimal"]
    assert cell["verdict"] == "vacuous" and cell["compared_ops"] == 3


def test_a_crash_is_saved_and_replays_as_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A crash inside the model saves its script like a violation; replaying it reports the
    crash (exit 1), never "no violation"."""
    from overlap_spec.harness.drive.stateful import check_cell, describe_failure, get_profile
    from overlap_spec.reference.scheduler import Scheduler
    from overlap_spec.spec.config import PRESETS, ModelConfig, get_cell

    original = Scheduler.admit

    def admit(self: Scheduler, prompt_len: int, max_new_tokens: int, *args: object,
              **kwargs: object) -> object:
        if prompt_len == 5:
            raise AssertionError("prompt of 5 refused")
        return original(self, prompt_len, max_new_tokens, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Scheduler, "admit", admit)
    config = ModelConfig(get_cell("ov-p1-none"), PRESETS["minimal"])
    result = check_cell(config, get_profile("ci"), 3, save_dir=tmp_path)
    assert result.error is not None and result.script_path is not None
    assert "replay: overlap-spec replay" in describe_failure(result)
    assert main(["replay", str(result.script_path)]) == 1
    out = capsys.readouterr().out
    assert "crashed: AssertionError: prompt of 5 refused" in out and "no violation" not in out


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_cells_limits_prints_the_ranges_scripts_are_checked_against(
        preset: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cells", "--limits", "--preset", preset]) == 0
    rows = {line.split()[0]: line.split()[1:]
            for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {c.name for c in enumerate_cells()}
    for cell in enumerate_cells():
        limits = get_op_limits(ModelConfig(cell, PRESETS[preset]))
        low, high = limits.prompt_len
        assert rows[cell.name][0] == f"{low}..{high}"
        assert rows[cell.name][3] == "{}..{}".format(*limits.accept_len)
        # The printed top is what a script may use; one more is refused.
        check_op_ranges(ModelConfig(cell, PRESETS[preset]), [Admit(high, 1)])
        with pytest.raises(ScriptError, match="prompt_len"):
            check_op_ranges(ModelConfig(cell, PRESETS[preset]), [Admit(high + 1, 1)])
