"""The pytest plugin (harness/pytest_plugin.py): its fixtures, in this suite and in a foreign
one (the README's example, run as written), the Hypothesis profiles behind
``--hypothesis-profile``, its lazy imports, and pytest staying out of the runtime."""

from __future__ import annotations

import ast
import os
import random
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.generate import generate_random_ops
from overlap_spec.harness.drive.script import (
    Script,
    apply_op,
    get_factory,
    load_script,
    run_script,
)
from overlap_spec.harness.drive.stateful import PROFILES
from overlap_spec.harness.pytest_plugin import (
    CheckerFactory,
    StrategiesFactory,
    TraceCheck,
    get_config,
)
from overlap_spec.harness.trace.check import record_script_trace
from overlap_spec.harness.trace.shim import record_shim_trace
from overlap_spec.spec.config import MINIMAL, REALISTIC, ModelConfig, get_cell
from overlap_spec.spec.invariants import InvariantViolation
from overlap_spec.spec.units import RequestId

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = "overlap_spec.harness.pytest_plugin"
MUTANT_SCRIPT = ROOT / "tests" / "data" / "mutant_scripts" / "ov-p1-none-minimal-B1.json"
# A foreign suite's run with the plugin named explicitly, whatever the installed metadata
# holds (the entry point itself: test_the_entry_point_loads_the_plugin).
EXPLICIT = ["-p", "hypothesispytest", "-p", PLUGIN, "-p", "no:cacheprovider"]


def _run_explicit(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(pytester.path)  # the subprocess runs (and finds its files) there
        patch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
        return pytester.runpytest_subprocess(*EXPLICIT, *args)


# ----------------------------------------------------------------------------- fixtures here
def test_the_suite_runs_with_the_plugin_once(request: pytest.FixtureRequest) -> None:
    import overlap_spec.harness.pytest_plugin as plugin

    manager = request.config.pluginmanager
    assert manager.is_registered(plugin)
    assert manager.get_name(plugin) in ("overlap_spec", PLUGIN)


def test_get_config_takes_a_name_a_cell_or_a_config() -> None:
    cell = get_cell("ov-p4-none")
    assert get_config("ov-p4-none") == ModelConfig(cell, MINIMAL)
    assert get_config(cell, "realistic") == ModelConfig(cell, REALISTIC)
    assert get_config(ModelConfig(cell, REALISTIC)).preset is REALISTIC
    with pytest.raises(KeyError, match="unknown cell 'ov-p9'; valid cells: ov-p1-none"):
        get_config("ov-p9")
    with pytest.raises(ValueError, match="unknown preset 'huge'; choose one of minimal"):
        get_config("ov-p4-none", "huge")


@settings(max_examples=25, derandomize=True, database=None)
@given(data=st.data())
def test_the_strategies_fixture_draws_inside_the_preset(
        data: st.DataObject, overlap_spec_strategies: StrategiesFactory) -> None:
    draw = overlap_spec_strategies("ov-p4-v2chain-cpu-honest")
    assert 1 <= data.draw(draw.prompt_len) < MINIMAL.max_context_len
    accept_lens = data.draw(draw.accept_lens)
    assert len(accept_lens) == MINIMAL.max_running_requests
    assert data.draw(overlap_spec_strategies("ov-p4-none", upstream=True).spec_steps) == 0


def test_the_checker_fixture_catches_the_bug_a_saved_script_shows(
        overlap_spec_checker: CheckerFactory) -> None:
    script = load_script(MUTANT_SCRIPT)
    expected = run_script(script).violation
    assert expected is not None
    check = overlap_spec_checker(script.cell, script.preset)
    assert isinstance(check, InvariantChecker) and check is not overlap_spec_checker(script.cell)
    model = get_factory("reference")(check.config, frozenset(script.faults), check)
    with pytest.raises(InvariantViolation) as caught:
        admitted: list[RequestId] = []
        for index, op in enumerate(script.ops):
            model.set_step_index(index)
            apply_op(model, op, admitted)
    assert caught.value.invariant_id == expected.invariant_id
    assert check.exercised  # what it judged before the violation, per ID


def test_the_trace_fixture_gives_the_trace_checkers_verdict(
        overlap_spec_check_trace: TraceCheck, tmp_path: Path) -> None:
    failing = load_script(MUTANT_SCRIPT)
    recorded = record_script_trace(failing, tmp_path / "bug.trace.ndjson")
    verdict = overlap_spec_check_trace(str(tmp_path / "bug.trace.ndjson"))
    assert recorded.invariant_id is not None
    assert not verdict.ok and verdict.invariant_id == recorded.invariant_id
    assert verdict.invariant_id in verdict.describe()
    clean = Script(failing.cell, failing.preset, failing.ops)
    record_script_trace(clean, tmp_path / "clean.trace.ndjson")
    assert overlap_spec_check_trace(tmp_path / "clean.trace.ndjson").ok


# ----------------------------------------------------------------------------- a foreign suite
def _readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## In your own test suite\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) == 1, "the section holds one python example"
    return str(blocks[0])


def test_the_readme_example_runs_as_written(pytester: pytest.Pytester) -> None:
    example = _readme_example()
    cell = re.search(r'CELL = "([^"]+)"', example)
    assert cell is not None
    # The trace the example checks: a shim recording of a run, as around a live scheduler.
    ops = generate_random_ops(get_config(cell.group(1)), random.Random(7), 30)
    record_shim_trace(Script(cell.group(1), "minimal", ops), pytester.path / "live.trace.ndjson")
    pytester.makepyfile(test_sglang_overlap=example)
    result = _run_explicit(pytester)
    result.assert_outcomes(passed=example.count("\ndef test_"))


def test_the_readme_example_fails_on_a_broken_trace(pytester: pytest.Pytester) -> None:
    example = _readme_example()
    record_script_trace(load_script(MUTANT_SCRIPT), pytester.path / "live.trace.ndjson")
    pytester.makepyfile(test_sglang_overlap=example)
    result = _run_explicit(pytester)
    result.assert_outcomes(passed=example.count("\ndef test_") - 1, failed=1)
    result.stdout.fnmatch_lines(["*VIOLATION*", "*expected:*", "*actual:*"])


_PROFILE_PROBE = """
import os
from hypothesis import settings

def test_profile():
    assert settings.get_current_profile_name() == {name!r}
    assert settings.default.max_examples == {examples}
    assert settings.default.stateful_step_count == {steps}
    assert os.environ.get("HYPOTHESIS_PROFILE") == {name!r}
"""


@pytest.mark.parametrize("name", ["dev", "thorough"])
def test_hypothesis_profile_option_loads_the_project_profile(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.delenv("HYPOTHESIS_PROFILE", raising=False)
    profile = PROFILES[name]
    pytester.makepyfile(_PROFILE_PROBE.format(name=name, examples=profile.max_examples,
                                              steps=profile.step_count))
    _run_explicit(pytester, f"--hypothesis-profile={name}").assert_outcomes(passed=1)


def test_ci_stays_hypothesis_own_profile_and_a_suite_profile_wins(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed plugin must not change another suite's runs: Hypothesis's built-in
    ``ci`` (loaded by itself on CI machines) and a suite's own ``dev`` stay as they are."""
    monkeypatch.delenv("HYPOTHESIS_PROFILE", raising=False)
    pytester.makeconftest("from hypothesis import settings\n"
                          "settings.register_profile('dev', max_examples=7)\n")
    pytester.makepyfile("""
        from hypothesis import settings

        def test_ci():
            ci = settings.get_profile("ci")
            assert ci.derandomize and ci.max_examples == 100

        def test_dev():
            assert settings.default.max_examples == 7
    """)
    _run_explicit(pytester, "--hypothesis-profile=dev").assert_outcomes(passed=2)


def test_a_profile_option_and_variable_that_disagree_are_a_usage_error(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "ci")
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = _run_explicit(pytester, "--hypothesis-profile=dev")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--hypothesis-profile=dev and HYPOTHESIS_PROFILE=ci disagree*"])


def test_this_repository_runs_under_the_dev_profile() -> None:
    """``python -m pytest --hypothesis-profile=dev`` from the checkout, with its conftest: the
    profile is registered before Hypothesis's plugin loads it."""
    env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-v", "--hypothesis-profile=dev",
                           "tests/test_config.py::test_trees_on_pages_over_one_are_release_cells"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "hypothesis profile 'dev' -> " in done.stdout
    assert f"max_examples={PROFILES['dev'].max_examples}" in done.stdout


def test_the_entry_point_loads_the_plugin(pytester: pytest.Pytester) -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared["pytest11"] == {"overlap_spec": PLUGIN}
    pytester.chdir()
    found = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m; "
         "print(*[e.value for e in m.entry_points(group='pytest11', name='overlap_spec')])"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(pytester.path), os.environ.get("PYTHONPATH")]))},
        capture_output=True, text=True, check=True)
    if found.stdout.strip() != PLUGIN:
        pytest.skip("the installed package's metadata predates the pytest11 entry point "
                    "(reinstall it: ./dev env)")
    pytester.makepyfile("""
        def test_loaded(request, overlap_spec_checker):
            assert request.config.pluginmanager.has_plugin("overlap_spec")
            assert overlap_spec_checker("ov-p1-none").applicable
    """)
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
    switched_off = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:overlap_spec")
    switched_off.assert_outcomes(errors=1)


# ----------------------------------------------------------------------------- what it costs
def test_loading_the_plugin_imports_neither_torch_nor_z3_nor_hypothesis() -> None:
    probe = (f"import sys, {PLUGIN}; "
             "print(sorted(m for m in ('torch', 'z3', 'hypothesis') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.strip() == "[]"


def test_no_runtime_module_imports_pytest() -> None:
    """pytest is a dev dependency: only the plugin, which pytest itself loads, imports it."""
    offenders = []
    for package in ("spec", "reference", "gpu_impl", "proofs", "upstream", "harness"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "harness" / "pytest_plugin.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n == "pytest" or n.startswith(("pytest.", "_pytest")) for n in names):
                    offenders.append(str(path.relative_to(ROOT)))
    assert not offenders
    runtime = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in runtime if d.startswith("pytest")]

