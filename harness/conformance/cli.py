"""``overlap-spec upstream``: sglang's own scheduler (the release, or a tree) against the spec.

``upstream check`` runs :mod:`overlap_spec.harness.conformance.tier` in one process per
cell (upstream allows one ``Scheduler`` per process) inside the upstream environment, each
forked from one cell server that imported sglang once
(:mod:`overlap_spec.harness.conformance.server`), merges the cells into one report (text,
and JSON with ``--json``) and exits 0 only if every drivable cell passed: no violation
outside the listed findings, no divergence outside the allow-list, no vacuous invariant,
no crash; it exits 3 and runs no cell when the tier cannot drive the sglang given (it does
not import, or a name :mod:`upstream.compat` lists is missing or has another signature).
``upstream replay FILE`` re-runs a saved upstream script. ``upstream compat`` prints every
name the tier relies on and whether this sglang has it. ``upstream stand-ins`` and
``upstream findings`` print what the tier replaces and knows.

Which Python runs the cells: ``$OVERLAP_SPEC_UPSTREAM_PYTHON``; else this interpreter if
it can import sglang; else ``.venv-upstream/bin/python`` at the checkout's root (what
``./dev upstream`` builds). Which sglang: ``--sglang-src DIR``, else the first ``sglang``
on ``PYTHONPATH``, else the installed release.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

# The report's building and rendering (harness/conformance/report.py), named here too:
# check and review import them from this module.
from overlap_spec.harness.conformance.report import (
    CANNOT_DRIVE,
    build_report,
    render_report,
    upstream_tier_report,
)
from overlap_spec.harness.drive.cells import (
    DEFAULT_SEED,
    PROFILE_NAMES,
    ArgumentParser,
    NoCellMatches,
    any_cell_patterns,
    check_sizes,
    format_sizes,
    get_upstream_config,
    output_dir,
    output_file,
    parse_sizes,
    positive_int,
    report_usage_error,
)
from overlap_spec.harness.drive.cells import UsageError as CommandUsageError
from overlap_spec.harness.drive.cells import select_cells as select_cell_records
from overlap_spec.harness.verdict import EXIT_CANNOT_DRIVE, CheckReport
from overlap_spec.spec.config import PRESETS, get_cell

REPO_ROOT = Path(__file__).resolve().parents[2]  # harness/conformance/cli.py
CELL_TIMEOUT_S = 900


class UsageError(CommandUsageError):
    """Bad input to ``overlap-spec upstream``: exit 2 with this one line."""


def get_installed_sglang_version() -> str | None:
    """The version of the sglang installed in this interpreter's environment (read from its
    metadata, without importing it), or None when there is none."""
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:  # importable, not installed: a tree
        return "unknown"


def find_upstream_python() -> tuple[str | None, str]:
    """The interpreter that drives sglang, and which environment that is, in words.

    In order: ``OVERLAP_SPEC_UPSTREAM_PYTHON``; this environment, when the sglang it has is
    the version the tier drives (``upstream.bootstrap.SUPPORTED_VERSION``); the project's
    ``.venv-upstream`` (``./dev upstream env``); this environment's other sglang (the tier
    then says it cannot drive it, exit 3). None when no environment has sglang."""
    from overlap_spec.upstream.bootstrap import SUPPORTED_VERSION

    explicit = os.environ.get("OVERLAP_SPEC_UPSTREAM_PYTHON")
    if explicit:
        return explicit, f"OVERLAP_SPEC_UPSTREAM_PYTHON ({explicit})"
    here = get_installed_sglang_version()
    if here == SUPPORTED_VERSION:
        return sys.executable, f"this environment ({sys.executable})"
    candidate = REPO_ROOT / ".venv-upstream" / "bin" / "python"
    if candidate.exists():
        why = ("" if here is None
               else f"; this environment's sglang {here} is not {SUPPORTED_VERSION}")
        return str(candidate), f".venv-upstream ({candidate}{why})"
    if here is not None:
        return sys.executable, f"this environment ({sys.executable}; sglang {here})"
    return None, "none: no sglang in this environment and no .venv-upstream"


def get_upstream_python() -> str | None:
    """The interpreter that can import sglang, or None when there is no upstream env."""
    return find_upstream_python()[0]


def _require_python() -> str:
    python = get_upstream_python()
    if python is None:
        from overlap_spec.upstream.bootstrap import SUPPORTED_VERSION

        raise UsageError(f"no sglang to drive: install sglang {SUPPORTED_VERSION} in this "
                         "environment, or build the upstream environment with './dev upstream "
                         "env' (or set OVERLAP_SPEC_UPSTREAM_PYTHON)")
    return python


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # The checkout first (the upstream env has it installed in editable mode, but a
    # plain interpreter given by OVERLAP_SPEC_UPSTREAM_PYTHON may not); a PYTHONPATH the
    # user set (a copy of sglang placed first) stays in front of it.
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*parts, str(REPO_ROOT)])
    env.setdefault("SGLANG_DISABLE_REQUEST_LOGGING", "1")
    return env


def select_cells(patterns: str | None, radix: bool = False,
                 with_radix: bool = False) -> list[str]:
    """The cells' names (:func:`overlap_spec.harness.drive.cells.select_cells`): the radix
    cells only with ``radix`` (``--radix``), both with ``with_radix`` (``check``'s run)."""
    try:
        return [c.name for c in select_cell_records(patterns, radix, with_radix)]
    except NoCellMatches as error:
        hint = ("" if with_radix else "; radix cells need --radix" if not radix else
                "; --radix selects among the radix cells only")
        raise UsageError(f"{error}{hint}") from None


def _failed_cell(reason: str) -> dict[str, Any]:
    return {"verdict": "fail", "reason": reason, "invariants": {}, "findings": [],
            "differential": {"verdict": "n/a", "divergences": []}}




def _undrivable_cell(mismatches: list[dict[str, str]]) -> dict[str, Any]:
    reason = "; ".join(f"cannot drive this sglang: {m['hook']}: {m['change']}"
                       for m in mismatches)
    return {"verdict": CANNOT_DRIVE, "reason": reason, "invariants": {}, "findings": [],
            "differential": {"verdict": "n/a", "divergences": []}}


def stamp_scripts(result: dict[str, Any], sglang: dict[str, Any]) -> None:
    """Write into each finding and divergence script of a cell's result which sglang it
    was seen on (a field ``seen_on`` the script loader ignores)."""
    paths = [f.get("script") for f in result.get("findings", [])]
    paths += [d.get("script") for d in result.get("differential", {}).get("divergences", [])]
    for path in {p for p in paths if p}:
        try:
            raw = json.loads(Path(path).read_text())
            raw["seen_on"] = sglang
            Path(path).write_text(json.dumps(raw, indent=1) + "\n")
        except (OSError, ValueError):
            pass  # a script that cannot be stamped is still the script


def _last_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip() and not x.startswith("[20")]
    return lines[-1] if lines else "no output"


@dataclass
class CellServer:
    """A started cell server and the file its standard error goes to. Started with
    ``wait``, it imports sglang (and what a scheduler build imports) at once but runs no
    cell before :func:`collect_cell_server` tells it to: ``check`` starts it before its
    first tier, so the import overlaps the tiers that run before the upstream one."""

    process: subprocess.Popen[str]
    errors: IO[str]
    waiting: bool

    def stop(self) -> None:
        """Terminate it (and, through its SIGTERM handler, its cells) if still running."""
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait()
        self.errors.close()


def start_cell_server(python: str, cells: list[str], args: argparse.Namespace, out: Path,
                      wait: bool = False) -> CellServer:
    """Start :mod:`overlap_spec.harness.conformance.server` for ``cells``; a usage error
    if the interpreter cannot be run."""
    command = [python, "-W", "ignore", "-m", "overlap_spec.harness.conformance.server",
               "--cells", ",".join(cells), "--out", str(out), "--seed", str(args.seed),
               "--profile", args.profile, "--preset", args.preset, "--jobs", str(args.jobs),
               "--timeout", str(CELL_TIMEOUT_S)]
    if getattr(args, "sizes", None):
        command += ["--sizes", format_sizes(args.sizes)]
    if args.sglang_src:
        command += ["--sglang-src", str(args.sglang_src)]
    if wait:
        command.append("--wait")
    errors = tempfile.TemporaryFile("w+")
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True,
                                   stdin=subprocess.PIPE if wait else subprocess.DEVNULL,
                                   env=_child_env())
    except OSError as error:
        errors.close()
        raise UsageError(f"cannot run the upstream interpreter {python}: {error}") from None
    return CellServer(process, errors, wait)


def collect_cell_server(server: CellServer, python: str, cells: list[str], out: Path,
                        progress: bool, environment: str = ""
                        ) -> tuple[dict[str, Any], dict[str, dict[str, Any]],
                                   list[dict[str, str]]]:
    """sglang's version, source and commit, each cell's result, and what the tier cannot
    drive in this sglang (empty when nothing), from a started server (told to go on if it
    waits). An sglang that does not import, or lacks a name the tier relies on
    (:mod:`upstream.compat`), runs no cell: each is ``cannot-drive`` (exit 3); a bad tree
    is a usage error (exit 2); a cell that crashes, times out or is lost with the server
    is a failing cell, never a pass."""
    results: dict[str, dict[str, Any]] = {}
    sglang: dict[str, Any] | None = None
    mismatches: list[dict[str, str]] = []
    process = server.process
    try:
        if server.waiting:
            assert process.stdin is not None
            try:
                process.stdin.write("go\n")
                process.stdin.close()
            except OSError:  # BrokenPipeError: it exited already (the reason follows)
                pass
        assert process.stdout is not None
        for line in process.stdout:
            event = json.loads(line)
            kind = event["event"]
            if kind == "error":
                raise UsageError(event["message"])
            if kind == "cannot-drive":
                mismatches = event["mismatches"]
                sglang = event["sglang"] or {"version": "unknown", "source": "unknown"}
            elif kind == "sglang":
                sglang = {k: v for k, v in event.items() if k != "event"}
                if progress and environment:  # which sglang this run drives, first
                    print(f"  upstream: sglang {sglang.get('version')} of {environment}",
                          file=sys.stderr, flush=True)
            elif kind == "start" and progress:
                print(f"  upstream {event['cell']} ...", file=sys.stderr, flush=True)
            elif kind == "done":
                cell = event["cell"]
                result_path = out / f"{cell}.json"
                if event["exit"] != 0 or not result_path.exists():
                    result = _failed_cell(
                        f"the cell process failed (exit {event['exit']}): "
                        f"{event.get('reason') or 'no result written'}")
                else:
                    result = json.loads(result_path.read_text())
                    if sglang is not None:
                        stamp_scripts(result, sglang)
                result["wall_s"] = event["wall_s"]
                results[cell] = result
                if progress:
                    print(f"  upstream {cell}: {result['verdict']} ({event['wall_s']}s)",
                          file=sys.stderr, flush=True)
        code = process.wait()
        server.errors.seek(0)
        stderr = server.errors.read()
    finally:
        server.stop()
    if sglang is None:
        raise UsageError(f"{python} failed to import sglang (exit {code}): "
                         f"{_last_line(stderr)}")
    for cell in cells:
        if cell not in results:
            results[cell] = (_undrivable_cell(mismatches) if mismatches else _failed_cell(
                f"the cell server exited ({code}) before this cell finished: "
                f"{_last_line(stderr)}"))
    return sglang, results, mismatches


@dataclass
class UpstreamPlan:
    """A validated ``upstream check``: the cells, those the tier can drive, the others'
    n/a results, the interpreter and the output folder."""

    args: argparse.Namespace
    cells: list[str]
    runnable: list[str]
    results: dict[str, dict[str, Any]]
    python: str
    out: Path
    environment: str = ""  # which environment's sglang is driven, in words


def plan_upstream_check(args: argparse.Namespace) -> UpstreamPlan:
    """Validate the arguments and find the drivable cells; a :class:`UsageError` on bad
    input, before anything runs."""
    from overlap_spec.upstream.session import is_drivable

    _checked_sglang_src(args)
    if args.sglang_src is not None:
        args.sglang_src = Path(args.sglang_src).resolve()
    if args.preset not in PRESETS:
        raise UsageError(f"unknown preset {args.preset!r}; choose {', '.join(PRESETS)}")
    if args.profile not in PROFILE_NAMES:
        raise UsageError(f"unknown profile {args.profile!r}; choose "
                         f"{', '.join(PROFILE_NAMES)}")
    if args.jobs < 1:
        raise UsageError("--jobs must be >= 1")
    cells = select_cells(args.cells, getattr(args, "radix", False),
                         getattr(args, "with_radix", False))
    python = _require_python()
    environment = find_upstream_python()[1]
    out = Path(args.out or os.environ.get("OVERLAP_SPEC_OUT", ".overlap-spec")) / "upstream"
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    runnable = []
    for name in cells:
        config = get_upstream_config(get_cell(name), args.preset,
                                     getattr(args, "sizes", None) or {})
        problem = check_sizes(config)
        if problem is not None:
            raise UsageError(problem)
        reason = is_drivable(config)
        if reason is None:
            runnable.append(name)
        else:
            results[name] = {"verdict": "n/a", "reason": reason, "invariants": {},
                             "findings": [], "differential": {"verdict": "n/a",
                                                              "reason": reason,
                                                              "divergences": []}}
    return UpstreamPlan(args, cells, runnable, results, python, out, environment)


def start_upstream_check(plan: UpstreamPlan) -> CellServer:
    """The plan's cell server, started now and waiting: sglang imports while the caller
    does other work; :func:`run_upstream_check` with ``server=`` then runs the cells."""
    return start_cell_server(plan.python, plan.runnable, plan.args, plan.out, wait=True)


def run_upstream_check(args: argparse.Namespace, progress: bool = True,
                       plan: UpstreamPlan | None = None,
                       server: CellServer | None = None) -> dict[str, Any]:
    """Validate, preflight, run every selected cell, and build the report (with the
    ``plan`` and the ``server`` started from it, when given)."""
    plan = plan or plan_upstream_check(args)
    started = time.perf_counter()
    server = server or start_cell_server(plan.python, plan.runnable, plan.args, plan.out)
    sglang, ran, mismatches = collect_cell_server(server, plan.python, plan.runnable, plan.out,
                                                  progress, plan.environment)
    # Which environment's sglang was driven (this one's, or .venv-upstream's).
    sglang = {**sglang, "python": plan.python, "environment": plan.environment}
    results = {**plan.results, **ran}
    ordered = {c: results[c] for c in plan.cells}
    return build_report(ordered, sglang, plan.args, time.perf_counter() - started, mismatches)


def cmd_upstream(args: argparse.Namespace) -> int:
    """Exit codes: 0 every drivable cell passed; 1 a violation, divergence, crash or
    vacuous invariant; 3 the tier cannot drive this sglang (no cell ran); bad input raises
    a :class:`UsageError` (exit 2, one line) before any cell runs."""
    if getattr(args, "radix_force_miss", False):  # every process it starts inherits it
        from overlap_spec.upstream.fields import RADIX_FORCE_MISS_ENV

        os.environ[RADIX_FORCE_MISS_ENV] = "1"
    if getattr(args, "tree_core", None):  # the radix cells' tree core, for every process
        from overlap_spec.upstream.fields import TREE_CORE_ENV

        os.environ[TREE_CORE_ENV] = args.tree_core
    if args.action == "stand-ins":
        from overlap_spec.upstream.standins import describe_stand_ins

        print(describe_stand_ins())
        return 0
    if args.action == "findings":
        from overlap_spec.harness.conformance.findings import (
            ALLOWED_DIVERGENCES,
            KNOWN_FINDINGS,
        )

        for known in KNOWN_FINDINGS:
            print(f"{known.id} {known.invariant}: {known.summary}\n   upstream: "
                  f"{known.upstream}\n   see: {known.reference}")
        for entry in ALLOWED_DIVERGENCES:
            print(f"{entry.id} (allowed divergence, {entry.field}): {entry.reason}\n"
                  f"   upstream: {entry.upstream}")
        return 0
    if args.action == "replay":
        return cmd_upstream_replay(args)
    if args.action == "compat":
        return cmd_upstream_compat(args)
    if args.action == "export":  # writes text only: sglang is not needed
        from overlap_spec.harness.conformance.export import ExportError, run_export

        try:
            return run_export(args.file, args.out)
        except ExportError as error:
            raise UsageError(str(error)) from None
    report = run_upstream_check(args, progress=not args.quiet)
    print(render_report(report))
    if args.json is not None:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    verdict = CheckReport(args.seed, args.profile)
    verdict.add(upstream_tier_report(report))
    return verdict.exit_code


def _checked_sglang_src(args: argparse.Namespace) -> None:
    """``--sglang-src`` must be an SGLang tree (a usage error otherwise)."""
    from overlap_spec.upstream.bootstrap import UpstreamUnavailable, find_package_dir

    if args.sglang_src is None:
        return
    src = Path(args.sglang_src)
    if not src.is_dir():
        raise UsageError(f"--sglang-src {src}: no such directory")
    try:
        find_package_dir(src.resolve())
    except UpstreamUnavailable as error:
        raise UsageError(str(error.args[0])) from None


def _reexec_upstream(args: argparse.Namespace, action: str, *extra: str) -> int:
    """Run this action again in the upstream environment (where sglang imports)."""
    python = _require_python()
    command = [python, "-W", "ignore", "-m", "overlap_spec.harness.conformance.cli", action,
               *extra]
    if args.sglang_src:
        command += ["--sglang-src", str(args.sglang_src)]
    return subprocess.run(command, env=_child_env(), check=False).returncode


def cmd_upstream_compat(args: argparse.Namespace) -> int:
    """``upstream compat``: every sglang name the tier relies on (upstream/compat.py) and
    whether this sglang has it as expected. Exit 0 all present, 3 otherwise (or when it
    does not import), 2 on bad input."""
    _checked_sglang_src(args)
    if importlib.util.find_spec("sglang") is None:
        return _reexec_upstream(args, "compat")
    from overlap_spec.upstream.bootstrap import CannotDrive, UpstreamUnavailable, load_sglang
    from overlap_spec.upstream.compat import check_compat, render_compat

    src = Path(args.sglang_src) if args.sglang_src else None
    try:
        source = load_sglang(src, expected_version=None)
    except CannotDrive as error:
        print(f"cannot drive this sglang: {error.hook}: {error.args[0]}")
        return EXIT_CANNOT_DRIVE
    except UpstreamUnavailable as error:
        raise UsageError(str(error.args[0] if error.args else error)) from None
    rows = check_compat()
    print(source.describe())
    print(render_compat(rows))
    return EXIT_CANNOT_DRIVE if any(change is not None for _, change in rows) else 0


def cmd_upstream_replay(args: argparse.Namespace) -> int:
    """Replay a saved upstream script in the upstream environment (re-executing there)."""
    if not args.file:
        raise UsageError("upstream replay needs a script file")
    path = Path(args.file)
    if path.is_dir():
        raise UsageError(f"{path} is a directory, not a script file")
    if not path.is_file():
        raise UsageError(f"no such file {path}")
    if importlib.util.find_spec("sglang") is None:
        return _reexec_upstream(args, "replay", str(path))
    from overlap_spec.harness.conformance.findings import get_known_finding
    from overlap_spec.harness.conformance.tier import UpstreamChecker, replay_on_upstream
    from overlap_spec.harness.drive.script import ScriptError, load_script
    from overlap_spec.upstream.bootstrap import CannotDrive, UpstreamUnavailable, load_sglang
    from overlap_spec.upstream.compat import get_mismatches
    from overlap_spec.upstream.session import UpstreamCrash

    try:
        script = load_script(path)
        source = load_sglang(Path(args.sglang_src) if args.sglang_src else None)
    except CannotDrive as error:
        print(f"cannot drive this sglang: {error.hook}: {error.args[0]}")
        return EXIT_CANNOT_DRIVE
    except (ScriptError, UpstreamUnavailable) as error:
        raise UsageError(str(error.args[0] if error.args else error)) from None
    mismatches = get_mismatches()
    if mismatches:
        print(f"replaying {path} on {source.describe()}: not run")
        print("\n".join(m.line() for m in mismatches))
        return EXIT_CANNOT_DRIVE
    if script.implementation == "upstream-differential":
        from overlap_spec.harness.conformance.tier import replay_differential

        try:
            compared, divergence, explained = replay_differential(script)
        except UpstreamCrash as crash:
            print(f"replaying the reference against sglang {source.version} "
                  f"({source.source}) in cell {script.get_config().name}: crashed")
            print(f"crash: {crash}")
            return 1
        print(f"replayed {compared} of {len(script.ops)} ops of the reference against sglang "
              f"{source.version} ({source.source}) in cell {script.get_config().name}, "
              f"seed {script.seed}" + (f"; allowed: {', '.join(explained)}" if explained else ""))
        if divergence is None:
            print("no unexplained divergence")
            return 0
        print(f"op {divergence['step']}: {divergence['field']}: reference "
              f"{divergence['reference']}, upstream {divergence['upstream']}")
        return 1
    if script.implementation != "upstream":
        raise UsageError(f"{path}: a {script.implementation} script; replay it with "
                         "'overlap-spec replay'")
    try:
        outcome = replay_on_upstream(script)
    except UpstreamCrash as crash:  # a crash is a finding, never a pass; no traceback
        print(f"replayed {len(script.ops)} ops on sglang {source.version} ({source.source}) "
              f"in cell {script.get_config().name}, seed {script.seed}: crashed")
        print(f"crash: {crash}")
        return 1
    print(f"replayed {len(script.ops)} ops on sglang {source.version} ({source.source}) in "
          f"cell {script.get_config().name}, seed {script.seed}")
    if isinstance(outcome, UpstreamChecker):
        for fid, count in sorted(outcome.findings.items()):
            known = get_known_finding(fid)
            print(f"listed finding {fid} ({known.invariant}) seen {count} time(s): "
                  f"{outcome.finding_messages[fid]}")
            if outcome.halted_by == fid:
                print(f"  nothing after it was judged: {known.halts}")
        print("no violation outside the listed findings")
        return 0
    print(f"{outcome}")
    return 1


def add_upstream_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["check", "replay", "compat", "stand-ins",
                                           "findings", "export"],
                        help="check: run the tier; replay FILE: re-run a saved upstream "
                             "script; compat: every sglang name the tier relies on and "
                             "whether this sglang has it; stand-ins: what the tier replaces "
                             "in sglang; findings: the listed findings and allowed "
                             "divergences; export FINDING: the finding as a standalone "
                             "pytest file (stdout, or into --out DIR)")
    parser.add_argument("file", nargs="?",
                        help="the script, for 'replay'; the finding (U5, U6, U7, or all "
                             "with --out), for 'export'")
    parser.add_argument("--cells", type=any_cell_patterns, default=None,
                        help="comma-separated cell names or globs (default: every cell, or "
                             "every radix cell with --radix; cells the adapter cannot drive "
                             "report n/a)")
    parser.add_argument("--sglang-src", default=None, metavar="DIR",
                        help="drive this SGLang source tree (a PR branch checkout) instead of "
                             "the installed release")
    parser.add_argument("--json", type=output_file, metavar="PATH",
                        help="write the JSON report here")
    parser.add_argument("--out", type=output_dir, metavar="DIR",
                        help="scripts are saved under DIR/upstream (default: .overlap-spec); "
                             "for 'export', the folder the test file is written into")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help=f"hypothesis seed (default {DEFAULT_SEED})")
    parser.add_argument("--profile", choices=PROFILE_NAMES, default="ci",
                        help="hypothesis budget (default ci)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="minimal",
                        help="sizes (default minimal)")
    parser.add_argument("--sizes", type=parse_sizes, metavar="NAME=N,...", default=None,
                        help="sizes in place of the preset's, as for 'overlap-spec review'")
    parser.add_argument("-j", "--jobs", type=positive_int,
                        default=max(1, min(2, os.cpu_count() or 1)),
                        help="cells run at once, one forked process each (default %(default)s)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--radix", action="store_true",
                        help="drive the radix cells instead (overlap-spec cells --radix): the "
                             "release's prefix cache on and shared, prompts drawn from a few "
                             "families, the tree compared by the differential and judged by "
                             "the RX invariants (docs/upstream-tier.md)")
    parser.add_argument("--tree-core", choices=("python", "rust"), default=None,
                        help="the radix cells' tree core (default python; rust is the "
                             "release's own default): on rust the tree's nodes, locks, pages "
                             "and sizes are read from the core, its keys' tokens are not "
                             "(docs/upstream-tier.md)")
    parser.add_argument("--radix-force-miss", action="store_true",
                        help="run the release's own radix tree (python core, bigram keys "
                             "under EAGLE) with every match forced to miss "
                             "(SGLANG_RADIX_FORCE_MISS): inserts, locks and eviction run, "
                             "nothing is shared; KV7 counts its unlocked pages and KV9 judges "
                             "what it keyed (docs/upstream-tier.md)")


UPSTREAM_EPILOG = """exit codes: 0 every drivable cell passed (compat: every name present);
1 a violation outside the listed findings, an unexplained divergence, a crash or a vacuous
invariant; 2 a usage error, found before any cell runs (one line on stderr); 3 the tier
cannot drive this sglang: it does not import, or a name the tier relies on is missing or
has another signature (each cell says 'cannot drive this sglang: <hook>: <what changed>';
'overlap-spec upstream compat' lists every name)."""


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="overlap-spec upstream", epilog=UPSTREAM_EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_upstream_arguments(parser)
    try:
        return cmd_upstream(parser.parse_args(argv))
    except CommandUsageError as error:
        return report_usage_error(error)


if __name__ == "__main__":
    # A release that crashed mid-run leaves its threads behind, and the interpreter's
    # teardown can then abort ("terminate called without an active exception", SIGABRT):
    # a replay that reported the crash and returned 1 exited -6 once in CI (2026-11-28).
    # The verdict is printed and flushed by now, so leave without the teardown.
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
