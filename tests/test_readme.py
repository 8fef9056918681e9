"""The README's examples are true: every ``console`` block's command is run and the lines
it shows must appear, in order and together, in what the command prints (timings and the
failure folder normalised)."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from overlap_spec.harness.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
MUTANTS = README.parent / "docs" / "mutants.md"  # the mutant matrix's table


def get_console_examples(text: str) -> list[tuple[str, list[str]]]:
    """(command, the lines shown after it) for each ``$ overlap-spec ...`` in a console
    block."""
    examples: list[tuple[str, list[str]]] = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                examples.append((line[2:], []))
            elif examples:
                examples[-1][1].append(line)
    return examples


def _normalise(line: str, out_dir: str) -> str:
    line = line.replace(out_dir, ".overlap-spec")
    return re.sub(r"\d+\.\d+s\b", "<seconds>", line).rstrip()


EXAMPLES = get_console_examples(README.read_text())
# An example that runs the Hypothesis tier over all 32 cells takes about a minute of CPU: it
# is ``slow``, and .ci/run runs it (its step of the default tier's long tests), so the
# README's output is still checked on every CI run.
SLOW_EXAMPLES = frozenset({"overlap-spec review --faults B3"})


def test_the_readme_has_console_examples_and_the_first_is_the_reviewers() -> None:
    assert len(EXAMPLES) >= 2
    assert EXAMPLES[0][0].startswith("overlap-spec review")
    first_block = README.read_text().index("```")
    assert README.read_text()[first_block:].startswith("```console\n$ overlap-spec review")
    assert SLOW_EXAMPLES <= {command for command, _ in EXAMPLES}  # none left stale


@pytest.mark.parametrize("command,shown", [
    pytest.param(command, shown, id=command,
                 marks=pytest.mark.slow if command in SLOW_EXAMPLES else ())
    for command, shown in EXAMPLES])
def test_readme_example_prints_what_the_readme_shows(
        command: str, shown: list[str], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    argv = shlex.split(command)
    assert argv[0] == "overlap-spec", command
    # The command as written, on one job: what it prints does not depend on --jobs, and
    # spawned workers (each importing torch and Z3 afresh) would compete with the other
    # test workers; tests/test_script_cli.py runs check's tiers on spawned workers.
    monkeypatch.setattr("overlap_spec.harness.cli.get_default_jobs", lambda: 1)
    main(argv[1:])
    out_dir = os.environ["OVERLAP_SPEC_OUT"]  # tests/conftest.py: a temporary folder
    printed = [_normalise(line, out_dir) for line in capsys.readouterr().out.splitlines()]
    expected = [_normalise(line, out_dir) for line in shown if line.strip()]
    assert expected, f"the README shows nothing after `{command}`"
    starts = [i for i, line in enumerate(printed) if line == expected[0]]
    assert any(printed[i:i + len(expected)] == expected for i in starts), (
        "the README shows:\n" + "\n".join(expected) + "\n\nthe command printed:\n"
        + "\n".join(printed))
    # No example leaves an invariant without witness (review prints "no witness" for it):
    # the review example stands in for tests/test_stateful.py in the cells it runs clean.
    assert not any(line.startswith("no witness") for line in printed), "\n".join(printed)


def test_the_mutant_table_lists_the_catalogues_invariants() -> None:
    """Each row of docs/mutants.md's table names exactly the invariants harness/catalogue.py
    lists for that bug (a kill outside them is ``other-id`` and fails the matrix)."""
    from overlap_spec.harness.catalogue import BUGS

    found = re.findall(r"^\| (B\d+) \| .*? \| ([^|\n]*) \| ([^|\n]*) \|$", MUTANTS.read_text(),
                       flags=re.M)
    rows = {bug_id: invariants for bug_id, _, invariants in found}
    assert sorted(rows) == sorted(bug.id for bug in BUGS)
    for bug in BUGS:  # "SL1", "SL1; or the crash `crash:...`", "the crash `crash:...`"
        shown = [", ".join(bug.invariants)] if bug.invariants else []
        shown += [f"the crash `{bug.crash.label}`"] if bug.crash is not None else []
        assert rows[bug.id] == "; or ".join(shown), bug.id
    # The "in sglang 0.5.23" column marks exactly the catalogue's current-upstream bugs.
    status = {bug_id: state for bug_id, state, _ in found}
    for bug in BUGS:
        assert ("current upstream" in status[bug.id]) == bool(bug.current_upstream), bug.id


def test_the_readme_is_a_manual_that_cites_only_the_repository() -> None:
    """At most about 400 lines; every relative link resolves inside the repository; nothing
    points outside it (no ../shared, no "the digest")."""
    text = README.read_text()
    assert len(text.splitlines()) <= 400
    assert "../" not in text and "the digest" not in text
    for target in re.findall(r"\]\(([^)\s#]+)\)", text):
        if not target.startswith(("http://", "https://")):
            assert (README.parent / target).exists(), target


def test_the_moved_docs_links_resolve() -> None:
    """The design notes moved out of the README link to files that exist."""
    for page in (README.parent / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)\s#]+)\)", page.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (page.parent / target).exists(), (page.name, target)
