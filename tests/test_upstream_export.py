"""``overlap-spec upstream export FINDING``: the listed findings as standalone pytest files.

On CPU (no sglang): the files committed under ``docs/findings/`` are what ``export`` writes
now (they cannot go stale), they import nothing from overlap-spec, and bad finding ids are
one line and exit 2. In the upstream environment (marked ``upstream``: ``./dev upstream
test``): each committed file, run by pytest on its own outside the checkout, fails on
sglang 0.5.23 in every test it holds and with the finding's assertion (a strict expected
failure: a crash, an import error or another assertion does not count), and passes on a
copy of the release with a candidate fix (so it fails for the finding, not by accident).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from overlap_spec.harness.cli import main
from overlap_spec.harness.conformance.export import (
    EXPORTS,
    FINDINGS_DIR,
    RELEASE,
    export_finding,
    get_exportable,
)
from overlap_spec.harness.conformance.findings import get_known_finding

ROOT = Path(__file__).resolve().parents[1]
HAS_SGLANG = importlib.util.find_spec("sglang") is not None
needs_sglang = pytest.mark.skipif(
    not HAS_SGLANG, reason="sglang 0.5.23 is not installed here (build it with ./dev upstream)")
# What an exported file may import beside the standard library.
ALLOWED_IMPORTS = {"sglang", "torch", "pytest", "transformers", "torchvision"}


def committed(finding: str) -> Path:
    return ROOT / FINDINGS_DIR / EXPORTS[finding].filename


# ---------------------------------------------------------------------- CPU


def test_the_exportable_findings_are_listed_ones() -> None:
    assert get_exportable() == ("U5", "U6", "U7")
    for finding in get_exportable():
        get_known_finding(finding)  # raises for an id KNOWN_FINDINGS does not list


@pytest.mark.parametrize("finding", get_exportable())
def test_the_committed_file_is_what_export_writes_now(finding: str) -> None:
    """Regenerate with ``overlap-spec upstream export all --out docs/findings``."""
    assert committed(finding).read_text() == export_finding(finding), (
        f"{committed(finding)} is stale: run 'overlap-spec upstream export all --out "
        f"{FINDINGS_DIR}'")


def test_docs_findings_holds_exactly_the_exported_files() -> None:
    files = {p.name for p in (ROOT / FINDINGS_DIR).glob("*.py")}
    assert files == {EXPORTS[f].filename for f in get_exportable()}


@pytest.mark.parametrize("finding", get_exportable())
def test_an_exported_file_is_standalone_and_says_where_and_how(finding: str) -> None:
    text = export_finding(finding)
    tree = ast.parse(text)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import"
            imported.add((node.module or "").split(".")[0])
    others = imported - ALLOWED_IMPORTS - set(sys.stdlib_module_names)
    assert others == set(), f"the file imports {others}"
    assert "sglang" in imported and "overlap_spec" not in text
    docstring = ast.get_docstring(tree) or ""
    known = get_known_finding(finding)
    template = EXPORTS[finding]
    where = re.match(r"\S+\.py:\d+", known.upstream)
    assert where is not None and where.group(0) in docstring
    assert f"pytest {FINDINGS_DIR / template.filename}" in docstring
    assert f"fails on sglang {RELEASE}" in docstring and "pass once" in docstring
    assert all(len(line) <= 100 for line in text.splitlines())
    # Every test the upstream tier expects to fail states the finding in its message.
    assert f'f"{template.failure}' in text
    for test in template.tests:
        assert f"def {test.split('[')[0]}(" in text


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed")
def test_the_committed_files_pass_the_projects_lint() -> None:
    """docs/ is outside ./dev lint's paths; the exported files are held to its rules."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                           str(ROOT / FINDINGS_DIR)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_export_writes_stdout_or_into_a_folder(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["upstream", "export", "u7"]) == 0
    assert capsys.readouterr().out == export_finding("U7")
    assert main(["upstream", "export", "U5", "--out", str(tmp_path / "one")]) == 0
    assert (tmp_path / "one" / EXPORTS["U5"].filename).read_text() == export_finding("U5")
    assert main(["upstream", "export", "all", "--out", str(tmp_path / "all")]) == 0
    out = capsys.readouterr().out
    for finding in get_exportable():
        path = tmp_path / "all" / EXPORTS[finding].filename
        assert path.read_text() == export_finding(finding) and f"wrote {path}" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["export"], "upstream export needs a finding: one of U5, U6, U7"),
    (["export", "U9"], "finding 'U9' is not a listed finding; exportable: U5, U6, U7"),
    (["export", "U3"], "finding 'U3' has no exported test; exportable: U5, U6, U7"),
    (["export", "all"], "upstream export all needs --out DIR"),
    (["export", "U1", "--out", "{tmp}"], "finding 'U1' is not a listed finding"),
])
def test_a_bad_finding_is_one_line_and_exit_2(argv: list[str], message: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["upstream", *[a.format(tmp=tmp_path / "out") for a in argv]])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("overlap-spec: error: "), err
    assert message in lines[0], lines[0]
    assert out == "" and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- upstream

# A candidate fix per finding, applied to a copy of the release: (file, old, new). The
# exported test must pass on it (it is a regression test, not a test of something else).
_FINISH_FIX = ("managers/schedule_batch.py", """        if self.to_finish:
            self.finished_reason = self.to_finish
            self.to_finish = None
            return
""", """        if self.to_finish:
            self.finished_reason = self.to_finish
            self.to_finish = None
            # candidate fix: cut the visible output at a stop in the run and at the cap
            run = self.output_ids[len(self.output_ids) - new_accepted_len:]
            stops = set(self.sampling_params.stop_token_ids or ()) | set(
                self.eos_token_ids or ())
            for i, token_id in enumerate(run):
                if token_id in stops:
                    self.finished_len = len(self.output_ids) - len(run) + i + 1
                    break
            cap = self.sampling_params.max_new_tokens
            if (self.finished_len or len(self.output_ids)) > cap:
                self.finished_len = cap
            return
""")
CANDIDATE_FIXES: dict[str, tuple[str, str, str]] = {
    "U5": _FINISH_FIX,
    "U6": _FINISH_FIX,
    # The row widened to the decode reserve on every page size.
    "U7": ("mem_cache/allocation_sizing.py", "        if page_size > 1 or spec_algo.is_uno():",
           "        if True:  # candidate fix: every page size"),
}


def run_exported(finding: str, where: Path, pythonpath: str | None = None
                 ) -> subprocess.CompletedProcess[str]:
    """pytest on the committed file alone, copied outside the checkout (no rootdir config,
    no conftest, overlap-spec's pytest plugin off)."""
    where.mkdir(parents=True, exist_ok=True)
    target = where / committed(finding).name
    shutil.copyfile(committed(finding), target)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["COLUMNS"] = "2000"  # the short summary keeps each failure's message whole
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider",
                           "-p", "no:overlap_spec", "-p", "no:xdist", "-W", "ignore",
                           target.name], capture_output=True, text=True, cwd=where, env=env,
                          timeout=600, check=False)


@pytest.mark.upstream
@needs_sglang
@pytest.mark.parametrize("finding", get_exportable())
def test_an_exported_finding_fails_on_the_release_as_it_says(finding: str,
                                                              tmp_path: Path) -> None:
    template = EXPORTS[finding]
    done = run_exported(finding, tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-4000:]
    count = len(template.tests)
    assert re.search(rf"^{count} failed in ", output, re.MULTILINE), output[-4000:]
    assert not re.search(r"\b(passed|error|errors|skipped|xfailed|xpassed)\b",
                         output.splitlines()[-1]), output[-4000:]
    for test in template.tests:
        expected = f"FAILED {template.filename}::{test} - AssertionError: {template.failure}"
        assert any(line.startswith(expected) for line in output.splitlines()), (
            f"{test} did not fail with the finding's assertion:\n{output[-4000:]}")


def make_fixed_copy(root: Path, finding: str) -> Path:
    """The installed release, hard-linked into ``root/tree/sglang``, with the finding's
    candidate fix in one file (a new inode: the release's own file stays intact)."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    release = Path(next(iter(spec.submodule_search_locations)))
    tree = root / "tree"
    shutil.copytree(release, tree / "sglang", copy_function=os.link,
                    ignore=shutil.ignore_patterns("__pycache__"))
    relative, old, new = CANDIDATE_FIXES[finding]
    target = tree / "sglang" / "srt" / relative
    text = target.read_text()
    assert text.count(old) == 1, f"{relative}: the text to fix is not there exactly once"
    target.unlink()
    target.write_text(text.replace(old, new))
    return tree


@pytest.mark.upstream
@needs_sglang
@pytest.mark.parametrize("finding", get_exportable())
def test_an_exported_finding_passes_once_fixed(finding: str, tmp_path: Path) -> None:
    tree = make_fixed_copy(tmp_path, finding)
    done = run_exported(finding, tmp_path / "run", pythonpath=str(tree))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert re.search(rf"^{len(EXPORTS[finding].tests)} passed in ", output, re.MULTILINE), \
        output[-4000:]
