"""The GPU evidence run (``./dev cuda``, ``harness/measure/gpu_evidence.py``) works before it
meets a GPU: its dry run goes through every step on CPU (the same children, the same step
functions, the differential's worker processes), writes what it says it writes, reports a
skipped step with its reason and a failing step as failed; and ``gpu_impl/race.py`` names
any sanitizer internal a torch lacks."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch.cuda._sanitizer as csan

from overlap_spec.gpu_impl.race import (
    SANITIZER_API,
    check_sanitizer_api,
    get_missing_sanitizer_api,
)
from overlap_spec.harness.measure.gpu_evidence import STATUSES, STEPS, run_evidence

ROOT = Path(__file__).resolve().parent.parent


def _summary(out: Path) -> dict[str, object]:
    document: dict[str, object] = json.loads((out / "summary.json").read_text())
    return document


# Six child processes that each import torch, and the differential in two cells: about
# 25 s of CPU, so ``slow``; .ci/run runs it (its step of the default tier's long tests). The
# default tier keeps the same steps' machinery below: a failing step, a dead or late child,
# the step list, the carried wheels (the environment step, run for real).
@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_writes_its_results(tmp_path: Path) -> None:
    out = tmp_path / "evidence"
    run = run_evidence(out, dry_run=True, command="test dry run")
    summary = _summary(out)
    steps = {s["name"]: s for s in summary["steps"]}  # type: ignore[attr-defined]
    assert list(steps) == list(STEPS)
    for name, step in steps.items():
        assert step["status"] in STATUSES, step
        assert step["seconds"] is not None and step["command"] and step["call"], step
        assert (out / f"{name}.log").is_file() and (out / f"{name}.json").is_file(), name
        result = json.loads((out / f"{name}.json").read_text())
        if name != "upstream":
            assert result["imported"] == {"z3": False, "sglang": False}, name  # device: none
    if importlib.util.find_spec("sglang") is None:
        assert steps["upstream"]["status"] == "skipped"
        assert "sglang is not importable" in steps["upstream"]["reason"]
    for name in STEPS[:-1]:
        assert steps[name]["status"] == "ok", steps[name]
        assert steps[name]["reason"] is None
    assert summary["status"] == run.status == "ok"
    assert summary["command"] == "test dry run" and summary["dry_run"] is True
    environment = summary["environment"]
    assert isinstance(environment, dict)
    for key in ("device_name", "torch", "torch_cuda", "driver", "python", "git_commit",
                "source_digest", "date"):
        assert key in environment, key
    assert environment["sanitizer_api_missing"] == []
    # The differential's cells, as they finished, and its verdict; the positive control
    # caught B8 as a race; bench gpu wrote its own files.
    partial = json.loads((out / "diff.partial.json").read_text())
    assert partial["finished"] == "2/2 cells" and partial["status"] == "pass"
    control = json.loads((out / "sanitizer-control.json").read_text())
    assert control["details"]["kind"].startswith("race:"), control
    assert list(out.glob("gpu-*.md")) and list(out.glob("gpu-*.json"))
    text = (out / "summary.md").read_text()
    assert "| upstream | skipped |" in text or "| upstream | ok |" in text
    assert "--step diff" in text and "run_differential_task" in text


def test_a_failing_step_is_reported_failed_and_the_run_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "evidence"
    run = run_evidence(out, dry_run=True, steps=("diff", "upstream"), inject_failure="diff",
                       command="test")
    steps = {s.name: s for s in run.steps}
    assert steps["diff"].status == "failed"
    assert steps["diff"].exit_code == 1
    assert "InjectedFailure" in (steps["diff"].reason or "")
    assert steps["upstream"].status in ("skipped", "ok")  # the next step still ran
    summary = _summary(out)
    assert summary["status"] == "failed" and summary["inject_failure"] == "diff"
    assert "a failure was injected into step diff" in (out / "summary.md").read_text()


def test_a_step_that_dies_without_a_result_or_outlives_its_limit_is_failed(
        tmp_path: Path) -> None:
    died = run_evidence(tmp_path / "died", dry_run=True, steps=("syncs",),
                        python="/bin/false", command="test")
    assert died.steps[0].status == "failed"
    assert (died.steps[0].reason or "").startswith("exited 1 without a result")
    # Half a second: a child that imports torch never finishes within it, on any machine.
    slow = run_evidence(tmp_path / "slow", dry_run=True, steps=("diff",),
                        limits={"diff": 0.5}, command="test")
    assert slow.steps[0].status == "failed"
    assert (slow.steps[0].reason or "").startswith("timed out after 0.5 s"), slow.steps[0]
    spent = run_evidence(tmp_path / "spent", dry_run=True, steps=("syncs",), budget_s=1,
                         command="test")
    assert spent.steps[0].status == "failed"
    assert "budget was spent" in (spent.steps[0].reason or "")


def test_dev_cuda_runs_the_evidence_module(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(ROOT / "dev"), "cuda", "--dry-run", "--steps",
                           "upstream", "--out", str(tmp_path / "e")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| upstream |" in done.stdout
    summary = _summary(tmp_path / "e")
    assert [s["name"] for s in summary["steps"]] == ["upstream"]  # type: ignore[attr-defined]


def test_the_step_list_is_checked() -> None:
    done = subprocess.run([sys.executable, "-m", "overlap_spec.harness.measure.gpu_evidence",
                           "--steps", "diff,nonsense"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 2 and "unknown step(s) ['nonsense']" in done.stderr


def test_the_race_detector_names_a_missing_sanitizer_internal() -> None:
    assert get_missing_sanitizer_api() == []
    fake = types.SimpleNamespace(**{name: getattr(csan, name) for name in dir(csan)
                                    if not name.startswith("__")})
    del fake.FACTORY_FUNCTION_REGEX

    class Renamed(csan.UnsynchronizedAccessError):
        def __init__(self, pointer: int, trace: object, current: object,
                     previous: object) -> None:
            super().__init__(pointer, None, current, previous)  # type: ignore[arg-type]

    class NoSyncs(csan.EventHandler):
        def __init__(self) -> None:
            super().__init__()
            del self.syncs

    fake.UnsynchronizedAccessError = Renamed
    fake.EventHandler = NoSyncs
    missing = get_missing_sanitizer_api(fake)
    assert missing == [
        "FACTORY_FUNCTION_REGEX",
        "UnsynchronizedAccessError(data_ptr, allocation_stack_trace, current_access, "
        "previous_access)",
        "EventHandler().syncs"], missing
    with pytest.raises(ImportError) as raised:
        check_sanitizer_api(fake)
    message = str(raised.value)
    assert "torch " in message and "FACTORY_FUNCTION_REGEX" in message
    assert "tested with torch" in message
    assert len(SANITIZER_API) == len(set(SANITIZER_API))


def test_carried_wheels_are_imported_first_by_every_step(tmp_path: Path) -> None:
    """``--wheels DIR``: how a package travels to the device machine (no registry there)."""
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "probe-1.0-py3-none-any.whl", "w") as archive:
        archive.writestr("overlap_spec_probe/__init__.py", "__version__ = '1.0'\n")
        archive.writestr("probe-1.0.dist-info/METADATA", "Name: probe\nVersion: 1.0\n")
    out = tmp_path / "evidence"
    run = run_evidence(out, dry_run=True, steps=("environment",), wheels=wheels,
                       command="test")
    assert run.status == "ok", run.steps
    summary = _summary(out)
    assert summary["wheels"] == ["probe-1.0-py3-none-any.whl"]
    environment = summary["environment"]
    assert isinstance(environment, dict)
    site = Path(environment["pythonpath"].split(":")[0])
    assert site.name.startswith("overlap-spec-wheels-") and not site.exists()  # cleaned up
    assert "carried wheels, imported first: probe-1.0" in (out / "summary.md").read_text()
    empty = subprocess.run([sys.executable, "-m", "overlap_spec.harness.measure.gpu_evidence",
                            "--dry-run", "--wheels", str(tmp_path), "--out", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert empty.returncode == 2 and "no .whl file there" in empty.stderr


def test_the_control_fails_when_the_clean_cell_already_fails() -> None:
    """A race every run has (the GPU's first run, 2026-11-29: the schedule stream was not the
    current stream) also "catches" B8; the control must say so instead of passing."""
    from types import SimpleNamespace

    from overlap_spec.harness.measure.evidence_steps import judge_control

    crash = "exception: reference=None gpu_impl='CUDASanitizerErrors: detected 1 errors'"
    failing = SimpleNamespace(examples=1, seconds=0.1, error=None,
                              failure=SimpleNamespace(outcome=SimpleNamespace(
                                  describe=lambda: crash)))
    verdict = judge_control("cell", True, failing, failing, "call")
    assert verdict.status == "failed"
    assert verdict.reason is not None and "the clean cell already fails" in verdict.reason
    assert "CUDASanitizerErrors" in verdict.reason
    passing = SimpleNamespace(examples=25, seconds=0.1, error=None, failure=None)
    missed = judge_control("cell", True, passing, passing, "call")
    assert missed.status == "failed" and "not caught" in (missed.reason or "")
