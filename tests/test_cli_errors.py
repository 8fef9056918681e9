"""Bad input to any command is one line on stderr and exit 2, never a traceback, found
before anything runs; the parser imports no torch, Z3 or Hypothesis.

The line is ``overlap-spec: error: MESSAGE`` whether argparse or a command found the
problem (no usage block: argparse's errors end with ``(see 'overlap-spec SUB --help')``).
The sweep below names bad input for every subcommand; a subcommand added to the parser
without an entry here fails :func:`test_every_subcommand_is_in_the_sweep`. Most cases run
in this process through ``main`` (fast); a handful run as real processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlap_spec.harness.cli import REVIEW_PROFILE, build_parser, main

ROOT = Path(__file__).resolve().parents[1]

GOOD_SCRIPT = {"version": 1, "cell": "ov-p1-v2chain-cpu-honest", "preset": "minimal",
               "faults": [], "seed": 1, "implementation": "reference",
               "ops": [{"op": "admit", "prompt_len": 3, "max_new_tokens": 4},
                       {"op": "iterate", "allow_prefill": True, "retract": 0,
                        "accept_lens": [2, 1, 1], "eos_positions": []}]}


def _script_with(index: int, **fields: object) -> dict[str, object]:
    raw = json.loads(json.dumps(GOOD_SCRIPT))
    raw["ops"][index].update(fields)
    return raw


# Files the cases name as {key}; written by the `paths` fixture.
FILES: dict[str, bytes | str | dict[str, object]] = {
    "file": "some text\n",
    "binary": b"\x00\xff\xfe\x89PNG\x00garbage",
    "empty": "",
    "list": "[1, 2]\n",
    "deep": "[" * 100_000,
    "bigint": '{"version": 1, "seed": ' + "9" * 5000 + "}",
    "script": GOOD_SCRIPT,
    "ops_not_a_list": {**GOOD_SCRIPT, "ops": {"op": "admit"}},
    "negative_prompt": _script_with(0, prompt_len=-5),
    "huge_prompt": _script_with(0, prompt_len=10**9),
    "huge_accept": _script_with(1, accept_lens=[10**9]),
    "unknown_cell": {**GOOD_SCRIPT, "cell": "ov-p9-none"},
    "trace_without_fields": '{"event": "header"}\n',
    "differential_script": {**GOOD_SCRIPT, "implementation": "upstream-differential"},
}

# (subcommand path) -> [(argv after the path, a substring the error line must hold)]
SWEEP: dict[tuple[str, ...], list[tuple[list[str], str]]] = {
    (): [
        ([], "required: command"),
        (["bogus"], "invalid choice: 'bogus'"),
        (["--bogus"], "required: command"),
    ],
    ("check",): [
        (["--json", "{dir}"], "is a directory"),
        (["--json", "{missing}/r.json"], "does not exist"),
        (["--out", "{file}"], "is a file, not a directory"),
        (["--out", "{file}/sub"], "is a file"),
        (["--jobs", "0"], "0 is out of range"),
        (["--jobs", "x"], "expected an integer, got 'x'"),
        (["--seed", "1.5"], "invalid int value"),
        (["--profile", "bogus"], "invalid choice: 'bogus'"),
        (["--preset", "huge"], "invalid choice: 'huge'"),
        (["--cells", "nope"], "no cell matches 'nope'"),
        # A misspelt name beside a good one is named, never silently left out.
        (["--cells", "ov-p1-none,ov-p4-v2tree-cpu-preclaim"],
         "no cell matches 'ov-p4-v2tree-cpu-preclaim'"),
        (["--faults", "B99"], "unknown bug IDs B99"),
        (["--sizes", "kv_tokens=0"], "size 'kv_tokens' is 0; allowed 1..8192"),
        (["--sizes", "kv_tokens=3"], "cell ov-p4-none needs whole pages of 4 tokens"),
        (["--sizes", "mixed_chunk=1"], "size 'mixed_chunk' is 1 without"),
    ],
    ("review",): [
        (["--jobs", "-1"], "-1 is out of range"),
        (["--json", "{dir}"], "is a directory"),
        (["--faults", "B0"], "unknown bug IDs B0"),
        (["--sglang-src", "{missing}"], "no such directory"),
        (["--profile", "fast"], "invalid choice: 'fast'"),
        (["--sizes", "kv_tokens=0"], "size 'kv_tokens' is 0; allowed 1..8192"),
        (["--sizes", "kv_tokens=3"], "cell ov-p4-none needs whole pages of 4 tokens"),
        (["--sizes", "pool=3"], "unknown size 'pool'; settable: kv_tokens"),
        (["--sizes", "chain_steps"], "expected NAME=N"),
        (["--sizes", "chain_steps=8"], "size 'chain_steps' is 8; allowed 1..7"),
    ],
    ("mutants",): [
        (["--bugs", "B99"], "unknown bug IDs B99"),
        (["--checkers", "nope"], "unknown checkers nope"),
        (["--checkers", ","], "no checkers given"),
        (["--json", "{dir}"], "is a directory"),
        (["--cells", "nope"], "no cell matches"),
        (["--preset", "all"], "invalid choice: 'all'"),
    ],
    ("exhaust",): [
        (["--sizes", "kv_tokens=-4"], "size 'kv_tokens' is -4; allowed 1..8192"),
        (["--sizes", "kv_tokens=9000"], "size 'kv_tokens' is 9000; allowed 1..8192"),
        (["--depth", "0"], "0 is out of range (allowed: 1..12)"),
        (["--depth", "13"], "13 is out of range"),
        (["--depth", "x"], "expected an integer, got 'x'"),
        (["--faults", "B99"], "unknown bug IDs B99"),
        (["--cells", "nope"], "no cell matches 'nope'"),
        (["--jobs", "0"], "0 is out of range"),
        (["--json", "{dir}"], "is a directory"),
        (["--json", "{missing}/e.json"], "does not exist"),
        (["--out", "{file}"], "is a file, not a directory"),
        (["--requests", "3"], "the full alphabet admits at most 2 (pd-decode: 3)"),
        (["--requests", "4", "--alphabet", "pd-decode"], "4 is out of range (allowed: 1..3)"),
        (["--alphabet", "pd"], "invalid choice: 'pd'"),
    ],
    ("diff",): [
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--device", "cuda:x"], "unknown device 'cuda:x'"),
        (["--device", "cuda:99"], "cuda:99"),
        (["--faults", "B98"], "unknown bug IDs B98"),
        (["--out", "{file}"], "is a file, not a directory"),
        (["--cells", "nope"], "no cell matches"),
        (["--sizes", "max_running_requests=33"], "allowed 1..32"),
    ],
    ("syncs",): [
        (["--batch-size", "0"], "0 is out of range (allowed: 1..4096)"),
        (["--batch-size", "-1"], "out of range"),
        (["--batch-size", "1000000000"], "out of range"),
        (["--device", "tpu"], "unknown device"),
    ],
    ("bench",): [
        ([], "required: target"),
        (["cpu"], "invalid choice: 'cpu'"),
        (["gpu", "--batch-sizes", "0"], "0 is out of range"),
        (["gpu", "--batch-sizes", "a,b"], "expected an integer, got 'a'"),
        (["gpu", "--batch-sizes", ","], "expected comma-separated integers"),
        (["gpu", "--iterations", "0"], "out of range"),
        (["gpu", "--iterations", "1000000000"], "out of range"),
        (["gpu", "--threads", "0"], "out of range"),
        (["gpu", "--out", "{file}"], "is a file, not a directory"),
    ],
    ("prove",): [
        (["-N", "-1"], "out of range"),
        (["-N", "1000000000"], "out of range"),
        (["-K", "0"], "out of range"),
        (["-B", "0"], "out of range"),
        (["--timeout-ms", "0"], "out of range"),
        (["--bmc-timeout-ms", "-5"], "out of range"),
        (["--jobs", "0"], "out of range"),
        (["--json", "{dir}"], "is a directory"),
        (["--json", "{missing}/p.json"], "does not exist"),
        (["--cells", "nope"], "no cell matches"),
    ],
    ("trace", "check"): [
        ([], "required: file"),
        (["{missing}"], "no such file"),
        (["{dir}"], "is a directory, not a file"),
        (["{binary}"], "cannot read"),
        (["{empty}"], "empty file"),
        (["{list}"], "expected a JSON object per line"),
        (["{deep}"], "cannot read"),
        (["{bigint}"], "cannot read"),
        (["{trace_without_fields}"], "line 1, field 'id'"),
        (["{empty}", "--context", "-1"], "out of range"),
        (["{empty}", "--json", "{dir}"], "is a directory"),
    ],
    ("trace", "render"): [
        (["{dir}"], "is a directory, not a file"),
        (["{binary}"], "cannot read"),
        (["{empty}", "--out", "{file}"], "is a file, not a directory"),
        (["{empty}", "--window", "-1"], "out of range"),
    ],
    ("trace", "plot"): [
        ([], "required: file"),
        (["{dir}"], "is a directory, not a file"),
        (["{binary}"], "cannot read"),
        (["{empty}", "-o", "{dir}"], "is a directory"),
        (["{empty}", "-o", "{missing}/p.svg"], "does not exist"),
        (["{trace_without_fields}"], "line 1, field 'id'"),
    ],
    ("trace", "record"): [
        (["{script}"], "required: -o/--output"),
        (["{dir}", "-o", "{tmp}/t.ndjson"], "is a directory, not a file"),
        (["{binary}", "-o", "{tmp}/t.ndjson"], "not JSON"),
        (["{negative_prompt}", "-o", "{tmp}/t.ndjson"], "op 0 (admit): field 'prompt_len'"),
        (["{script}", "-o", "{dir}"], "is a directory"),
        (["{script}", "-o", "{missing}/t.ndjson"], "does not exist"),
        (["{differential_script}", "-o", "{tmp}/t.ndjson"], "'overlap-spec upstream replay'"),
    ],
    ("trace", "strip"): [
        (["{binary}", "-o", "{tmp}/s.ndjson"], "cannot read"),
        (["{empty}", "-o", "{tmp}/s.ndjson"], "empty file"),
        (["{empty}", "-o", "{dir}"], "is a directory"),
        (["{deep}", "-o", "{tmp}/s.ndjson"], "cannot read"),
    ],
    ("vectors", "generate"): [
        ([], "required: dir"),
        (["{file}"], "is a file, not a directory"),
        (["{tmp}/v", "--scripts-per-cell", "0"], "out of range"),
        (["{tmp}/v", "--ops-per-script", "1000000000"], "out of range"),
    ],
    ("vectors", "check"): [
        (["{missing}"], "no such directory"),
        (["{file}"], "is a file, not a directory"),
        (["{dir}"], "no vectors under"),
    ],
    ("upstream",): [
        ([], "required: action"),
        (["bogus"], "invalid choice: 'bogus'"),
        (["check", "--json", "{dir}"], "is a directory"),
        (["check", "--out", "{file}"], "is a file, not a directory"),
        (["check", "--jobs", "0"], "out of range"),
        (["check", "--profile", "x"], "invalid choice: 'x'"),
        (["check", "--preset", "x"], "invalid choice: 'x'"),
        (["check", "--cells", "nope"], "no cell matches"),
        (["check", "--sglang-src", "{missing}"], "no such directory"),
        (["replay"], "needs a script file"),
        (["replay", "{missing}"], "no such file"),
        (["replay", "{dir}"], "is a directory"),
    ],
    ("replay",): [
        ([], "required: file"),
        (["{missing}"], "no such file"),
        (["{dir}"], "is a directory, not a file"),
        (["{binary}"], "not JSON (not UTF-8 text)"),
        (["{empty}"], "not JSON (line 1"),
        (["{list}"], "expected a JSON object"),
        (["{deep}"], "not JSON"),
        (["{bigint}"], "not JSON"),
        (["{ops_not_a_list}"], "field 'ops' must be list"),
        (["{unknown_cell}"], "unknown cell 'ov-p9-none'"),
        (["{negative_prompt}"], "op 0 (admit): field 'prompt_len' is -5; allowed 1..23"),
        (["{huge_prompt}"], "field 'prompt_len' is 1000000000"),
        (["{huge_accept}"], "op 1 (iterate): field 'accept_lens' is 1000000000; allowed 1..4"),
    ],
    ("cells",): [(["extra"], "unrecognized arguments: extra"),
                 (["--limits", "--preset", "huge"], "invalid choice: 'huge'")],
    ("invariants",): [(["--bogus"], "unrecognized arguments: --bogus")],
    ("witnesses",): [(["--bogus"], "unrecognized arguments: --bogus"),
                     (["-j", "0"], "argument -j/--jobs")],
}

CASES = [(path, argv, message) for path, cases in SWEEP.items() for argv, message in cases]
IDS = [" ".join([*path, *argv]) or "(no arguments)" for path, argv, _ in CASES]

# A handful run as real processes: what a user's shell sees, exit status included.
SUBPROCESS_CASES = [
    ["replay", "{dir}"],
    ["replay", "{negative_prompt}"],
    ["check", "--json", "{dir}"],
    ["bench", "gpu", "--batch-sizes", "0"],
    ["syncs", "--batch-size", "1000000000"],
    ["trace", "check", "{binary}"],
    [],
]

HEAVY = ("torch", "z3", "hypothesis", "overlap_spec.harness.check",
         "overlap_spec.harness.drive.stateful", "overlap_spec.harness.drive.script",
         "overlap_spec.reference.scheduler", "overlap_spec.gpu_impl.scheduler",
         "overlap_spec.proofs.solver", "overlap_spec.spec.invariants")


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, str]:
    """The placeholders' values: the files above, a directory, a path that does not exist."""
    values = {"tmp": str(tmp_path), "missing": str(tmp_path / "missing")}
    (tmp_path / "dir").mkdir()
    values["dir"] = str(tmp_path / "dir")
    for name, content in FILES.items():
        path = tmp_path / f"{name}.json"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        values[name] = str(path)
    return values


def _fill(argv: list[str], paths: dict[str, str]) -> list[str]:
    return [arg.format(**paths) for arg in argv]


def _get_leaf_commands(parser: argparse.ArgumentParser,
                       path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every runnable subcommand path, read from the parser itself."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        return {path}
    return {leaf for group in groups for name, child in group.choices.items()
            for leaf in _get_leaf_commands(child, (*path, name))}


def test_every_subcommand_is_in_the_sweep() -> None:
    leaves = _get_leaf_commands(build_parser())
    assert leaves - set(SWEEP) == set(), "subcommands without bad-input cases in SWEEP"
    assert set(SWEEP) - {()} - leaves == set(), "SWEEP names subcommands the parser lacks"


@pytest.mark.parametrize(("path", "argv", "message"), CASES, ids=IDS)
def test_bad_input_is_one_line_and_exit_2(path: tuple[str, ...], argv: list[str],
                                          message: str, paths: dict[str, str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*path, *_fill(argv, paths)])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("overlap-spec: error: "), err
    assert message.format(**paths) in lines[0], lines[0]
    assert "Traceback" not in out + err
    assert out == "", "the command started before its input was checked"


@pytest.mark.parametrize("argv", SUBPROCESS_CASES, ids=[" ".join(a) or "(none)"
                                                        for a in SUBPROCESS_CASES])
def test_bad_input_in_a_real_process(argv: list[str], paths: dict[str, str]) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "overlap_spec", *_fill(argv, paths)],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(lines) == 1 and lines[0].startswith("overlap-spec: error: "), done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_a_reader_that_went_away_is_no_traceback() -> None:
    """``overlap-spec cells | head``: the pipe closes early; the command stops quietly with
    the status a process killed by SIGPIPE has (128 + 13)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        done = subprocess.run([sys.executable, "-m", "overlap_spec", "cells"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=120,
                              check=False)
    finally:
        os.close(write_end)
    assert done.returncode == 141 and done.stderr == "", done.stderr


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root may write anywhere: no unwritable directory to point at")
def test_an_unwritable_output_is_refused_before_the_run(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert main(["check", "--json", str(locked / "r.json")]) == 2
        assert main(["check", "--out", str(locked / "out")]) == 2
    finally:
        locked.chmod(0o700)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all("permission denied" in line for line in err), err


def test_the_parser_imports_no_torch_z3_or_hypothesis() -> None:
    """Building the parser and every subcommand's ``--help`` in a fresh process: none of
    the heavy modules is imported (a count, not a timing)."""
    code = (
        "import json, sys\n"
        "from overlap_spec.harness.cli import build_parser, main\n"
        "build_parser()\n"
        f"for leaf in {sorted(_get_leaf_commands(build_parser()))!r}:\n"
        "    try:\n"
        "        main([*leaf, '--help'])\n"
        "    except SystemExit as done:\n"
        "        assert done.code == 0, leaf\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_what_the_parser_restates_agrees_with_its_source() -> None:
    """The parser names the profiles, the proofs' defaults and the render window without
    importing their modules; here they are compared with the modules that own them."""
    from overlap_spec.harness.drive import cells, script, stateful
    from overlap_spec.harness.prove import cli as prove_cli
    from overlap_spec.harness.prove import tier
    from overlap_spec.harness.trace import cli as trace_cli
    from overlap_spec.harness.trace import render
    from overlap_spec.proofs.induction import DEFAULT_BATCH_BOUND

    assert set(cells.PROFILE_NAMES) == set(stateful.PROFILES)
    assert REVIEW_PROFILE in stateful.PROFILES
    assert script.ABORT_INDEX_LIMIT == stateful.MAX_REQUESTS
    assert prove_cli.DEFAULT_BATCH_BOUND == DEFAULT_BATCH_BOUND
    assert prove_cli.DEFAULT_TIMEOUT_MS == tier.DEFAULT_TIMEOUT_MS
    assert prove_cli.DEFAULT_DEPTH == tier.DEFAULT_DEPTH
    assert prove_cli.DEFAULT_REQUESTS == tier.DEFAULT_REQUESTS
    assert prove_cli.DEFAULT_BMC_TIMEOUT_MS == tier.DEFAULT_BMC_TIMEOUT_MS
    assert trace_cli.DEFAULT_WINDOW == render.DEFAULT_WINDOW


# Paths no process can write, root included: /proc takes no new files, and a path under
# a regular file has no directory to go in.
UNWRITABLE = ["/proc/overlap-spec-report.json", "{file}/report.json"]
OUTPUT_OPTIONS = [
    (["check"], "--json"), (["check"], "--out"), (["review"], "--json"),
    (["review"], "--out"), (["mutants"], "--json"), (["exhaust"], "--json"),
    (["exhaust"], "--out"), (["diff"], "--out"), (["prove"], "--json"),
    (["upstream", "check"], "--json"), (["upstream", "check"], "--out"),
    (["trace", "check", "{file}"], "--json"), (["bench", "gpu"], "--out"),
]


@pytest.mark.parametrize("where", UNWRITABLE, ids=["proc", "under-a-file"])
@pytest.mark.parametrize(("command", "option"), OUTPUT_OPTIONS,
                         ids=[" ".join([*c, o]) for c, o in OUTPUT_OPTIONS])
def test_every_output_option_refuses_an_unwritable_path_first(
        command: list[str], option: str, where: str, paths: dict[str, str],
        capsys: pytest.CaptureFixture[str]) -> None:
    target = where.format(**paths)
    if option == "--out":
        target = target.removesuffix(".json")
    code = main([*_fill(command, paths), option, target])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith(f"overlap-spec: error: argument {option}"), err
    assert out == "", "the command started before its output path was checked"


def test_an_unwritable_json_ends_check_before_any_tier_runs() -> None:
    """Until the path was probed, root passed os.access on /proc and the whole run went by
    before the report could not be written (the verdict lost)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "overlap_spec", "check", "--cells", "ov-p1-none",
                           "--json", "/proc/overlap-spec-report.json"], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "", "a tier started"
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot write /proc/overlap-spec-report.json" in lines[0]
