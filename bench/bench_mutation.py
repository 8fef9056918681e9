"""Mutation score of the checkers, measured with cosmic-ray (issue 13, item 5).

    pip install -e '.[mutation]'          # cosmic-ray, into the project's environment
    .venv/bin/python bench/bench_mutation.py --layer spec --out bench/results

For one layer (``spec``: ``spec/transitions.py``; ``reference``; ``gpu_impl``) cosmic-ray
lists every mutation of its operators; each is applied in a throwaway clone of the
committed tree (the working tree is never touched) and the test command is run there:
by default ``overlap-spec review`` (the Hypothesis tier on the reference, profile
quick). A mutant the command fails on is killed; one it passes is a survivor. A mutation
inside a type annotation is equivalent by construction (every module has ``from
__future__ import annotations``: annotations are never evaluated) and is not run.

``--survivors-from FILE --command ... --checker NAME`` runs only the survivors a previous
result file lists, with a stronger command (for example the upstream tier, which compares
the reference with sglang 0.5.23): those it kills get ``"killed_by": NAME`` there and the
file is rewritten; the rest stay as they were. A survivor is judged at HEAD while its
module is the campaign's, or when exactly one mutation of HEAD's module is the same
operator on the same source line; else at the campaign's commit (with its checkers).

``--sample N`` runs N mutants drawn with ``--seed`` (the rest are reported as not run),
``--budget-s`` stops starting new ones after that many seconds: the result file says
which were run, so a partial run is never read as a whole one. The result is
``mutation-<date>.json``: ``{"tool", "command", "layers": {layer: {"killed",
"non_equivalent", "survivors": [{"id", "where", "diff", "equivalent_reason" |
"killed_by" | "status"}], ...}}}``; a survivor nobody has judged yet has
``"status": "unclassified"``. Nothing here is a test: the default tier never runs it.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {
    "spec": ["spec/transitions.py"],
    "reference": sorted(str(p.relative_to(ROOT)) for p in (ROOT / "reference").glob("*.py")
                        if p.name != "__init__.py"),
    "gpu_impl": sorted(str(p.relative_to(ROOT)) for p in (ROOT / "gpu_impl").glob("*.py")
                       if p.name != "__init__.py"),
}
DEFAULT_COMMAND = "{python} -m overlap_spec review -q -j {jobs} --out {scratch}"


def find_cosmic_ray() -> str:
    found = shutil.which("cosmic-ray") or str(Path(sys.executable).parent / "cosmic-ray")
    if not Path(found).exists():
        raise SystemExit("bench_mutation: cosmic-ray is not installed here; "
                         "pip install -e '.[mutation]' (cosmic-ray 8.7)")
    return found


def get_annotation_spans(path: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions, as (line, column), of every annotation in ``path``."""
    spans = []
    for node in ast.walk(ast.parse(path.read_text())):
        annotations: list[ast.expr | None] = []
        if isinstance(node, ast.arg):
            annotations.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            annotations.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        for a in annotations:
            if a is not None and a.end_lineno is not None and a.end_col_offset is not None:
                spans.append(((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)))
    return spans


def is_in_annotation(mutation: dict[str, Any], spans: list[Any]) -> bool:
    start, end = tuple(mutation["start_pos"]), tuple(mutation["end_pos"])
    return any(s <= start and end <= e for s, e in spans)


def list_mutations(cosmic_ray: str, clone: Path, modules: list[str]) -> list[dict[str, Any]]:
    config = clone / "cosmic-ray.toml"
    paths = ", ".join(json.dumps(m) for m in modules)
    config.write_text(f'[cosmic-ray]\nmodule-path = [{paths}]\ntimeout = 600.0\n'
                      'excluded-modules = []\ntest-command = "true"\n\n'
                      '[cosmic-ray.distributor]\nname = "local"\n')
    session = clone / "session.sqlite"
    subprocess.run([cosmic_ray, "init", str(config), str(session)], cwd=clone, check=True,
                   capture_output=True)
    dump = subprocess.run([cosmic_ray, "dump", str(session)], cwd=clone, check=True,
                          capture_output=True, text=True).stdout
    mutations = [json.loads(line)[0]["mutations"][0] for line in dump.splitlines() if line]
    return sorted(mutations, key=lambda m: (m["module_path"], m["start_pos"],
                                            m["operator_name"], m["occurrence"]))


def get_id(mutation: dict[str, Any]) -> str:
    return f"{mutation['module_path']}:{mutation['operator_name']}:{mutation['occurrence']}"


def run_one(cosmic_ray: str, clone: Path, mutation: dict[str, Any], command: str,
            timeout: float) -> dict[str, Any]:
    # Its own process group: on a timeout the test command's children go too (an orphaned
    # check would keep a core busy and slow every later mutant).
    process = subprocess.Popen(
        [cosmic_ray, "mutate-and-test", mutation["module_path"], mutation["operator_name"],
         str(mutation["occurrence"]), command],
        cwd=clone, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        subprocess.run(["git", "checkout", "--", "."], cwd=clone, check=True)
        return {"test_outcome": "timeout", "output": f"timed out after {timeout} s"}
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    subprocess.run(["git", "checkout", "--", "."], cwd=clone, check=True)  # never leak
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"test_outcome": "incompetent", "output": (done.stdout + done.stderr)[-400:]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


class CommandFailsThere(Exception):
    """The stronger command does not pass on the unmutated tree at that commit (it may
    not exist there yet): the survivors that would be judged there are not."""


def rerun_survivors(args: argparse.Namespace) -> int:
    """The unclassified survivors of a result file, with a stronger command.

    A survivor whose module is byte for byte the campaign's is judged at HEAD (where a
    check written for it lives); one whose module changed since is judged at the
    campaign's commit, with the checkers of that commit."""
    cosmic_ray = find_cosmic_ray()
    document = json.loads(args.survivors_from.read_text())
    layers = {name: layer for name, layer in document["layers"].items()
              if args.layer is None or name in args.layer}
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        command = args.command.format(python=sys.executable, jobs=args.jobs,
                                      scratch=scratch / "out")
        clones: dict[str, Path] = {}
        unusable: set[str] = set()

        def get_clone(commit: str) -> Path:
            """A clone at ``commit`` ("HEAD" or a campaign's), where the command passes."""
            if commit not in clones:
                clone = scratch / f"tree-{len(clones)}"
                subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
                if commit != "HEAD":
                    subprocess.run(["git", "checkout", "-q", commit], cwd=clone, check=True)
                    print(f"judging at the campaign's commit {commit[:12]} the survivors "
                          "whose module changed since", flush=True)
                modules = sorted({m for layer in layers.values() for m in layer["modules"]})
                list_mutations(cosmic_ray, clone, modules)
                # The command must pass on the unmutated tree, or its failures say nothing.
                clean = subprocess.run(command, shell=True, cwd=clone, capture_output=True,
                                       text=True, check=False)
                if clean.returncode != 0:
                    raise CommandFailsThere(
                        f"the command fails on the unmutated tree at {commit} (exit "
                        f"{clean.returncode}): {(clean.stdout + clean.stderr)[-300:]}")
                clones[commit] = clone
            return clones[commit]

        listed: dict[tuple[str, str], list[tuple[str, int, int]]] = {}

        def get_listed(commit: str, path: str) -> list[tuple[str, int, int]]:
            """(operator, occurrence, source line's index among the same operator's
            mutations on identical lines) of every mutation of ``path`` at ``commit``."""
            if (commit, path) not in listed:
                source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT,
                                        check=True, capture_output=True,
                                        text=True).stdout.splitlines()
                with tempfile.TemporaryDirectory() as where:
                    clone = Path(where) / "tree"
                    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
                    subprocess.run(["git", "checkout", "-q", commit], cwd=clone, check=True)
                    mutations = list_mutations(cosmic_ray, clone, [path])
                seen: dict[str, int] = {}
                rows = []
                for m in mutations:
                    key = f"{m['operator_name']}\0{source[m['start_pos'][0] - 1]}"
                    rows.append((key, m["occurrence"], seen.get(key, 0)))
                    seen[key] = seen.get(key, 0) + 1
                listed[(commit, path)] = rows
            return listed[(commit, path)]

        def find_at_head(path: str, operator: str, occurrence: int,
                         campaign: str) -> int | None:
            """The same operator on an identical source line, the same one among such
            mutations, at HEAD (the module moved, that line did not)."""
            before = {occ: (key, rank) for key, occ, rank in get_listed(campaign, path)
                      if key.startswith(operator + "\0")}
            if occurrence not in before:
                return None
            key, rank = before[occurrence]
            now = [occ for k, occ, r in get_listed(resolve_head(), path)
                   if k == key and r == rank]
            return now[0] if len(now) == 1 else None

        def resolve_head() -> str:
            return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout.strip()

        for layer in layers.values():
            campaign = layer.get("commit", document.get("commit"))
            for survivor in layer["survivors"]:
                if survivor.get("status") != "unclassified":
                    continue
                path, operator, occurrence = survivor["id"].rsplit(":", 2)
                moved = subprocess.run(["git", "diff", "--quiet", campaign, "HEAD", "--",
                                        path], cwd=ROOT, check=False).returncode != 0
                at, number = "HEAD", int(occurrence)
                if moved:
                    found = find_at_head(path, operator, int(occurrence), campaign)
                    if found is None:
                        at = campaign
                    else:
                        number = found
                        moved = False
                if at not in clones and at in unusable:
                    continue
                try:
                    get_clone(at)
                except CommandFailsThere as error:
                    unusable.add(at)
                    print(f"not judged: {error}", flush=True)
                    continue
                mutation = {"module_path": path, "operator_name": operator,
                            "occurrence": number}
                outcome = run_one(cosmic_ray, get_clone(at), mutation, command,
                                  args.timeout_s)
                status = outcome.get("test_outcome")
                # A kill is a failed check, not a usage error or a crash of the command.
                if status == "killed" and "FAILED" not in outcome.get("output", ""):
                    status = "not judged"
                print(f"{status:<11} {survivor['where']} {operator}", flush=True)
                if status == "killed":
                    survivor.pop("status")
                    survivor["killed_by"] = args.checker
                    if moved:
                        survivor["judged_at"] = campaign
            layer["killed_later"] = sum(1 for s in layer["survivors"] if "killed_by" in s)
    # Another run may have written other layers meanwhile: replace only the ones re-run.
    current = json.loads(args.survivors_from.read_text())
    current["layers"].update(layers)
    current.setdefault("later_commands", []).append(
        {"checker": args.checker, "layers": sorted(layers),
         "command": args.command.format(python="python", jobs=args.jobs, scratch="TMP")})
    args.survivors_from.write_text(json.dumps(current, indent=1) + "\n")
    print(f"rewritten: {args.survivors_from}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layer", choices=sorted(LAYERS), action="append",
                        help="the layer to mutate (repeatable); with --survivors-from, "
                             "only that layer's survivors are re-run")
    parser.add_argument("--command", default=DEFAULT_COMMAND,
                        help="test command; {python}, {jobs} and {scratch} are filled in "
                             "(default: overlap-spec review, the Hypothesis tier)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--sample", type=int, default=None, metavar="N")
    parser.add_argument("--seed", type=int, default=20261125)
    parser.add_argument("--budget-s", type=float, default=None)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--out", metavar="DIR")
    parser.add_argument("--survivors-from", type=Path, metavar="FILE",
                        help="re-run this result file's unclassified survivors with --command")
    parser.add_argument("--checker", default=None,
                        help="with --survivors-from: the name recorded as killed_by")
    args = parser.parse_args(argv)
    if args.survivors_from is not None:
        if args.checker is None or args.command == DEFAULT_COMMAND:
            parser.error("--survivors-from needs --command (a stronger check) and --checker")
        return rerun_survivors(args)
    if not args.layer:
        parser.error("--layer is required")
    if args.sample is not None and args.sample < 1:
        parser.error("--sample must be at least 1")
    cosmic_ray = find_cosmic_ray()
    started = time.perf_counter()
    result: dict[str, Any] = {"tool": "cosmic-ray 8.7.0", "layers": {}}
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        clone = scratch / "tree"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        command = args.command.format(python=sys.executable, jobs=args.jobs,
                                      scratch=scratch / "out")
        result["command"] = args.command.format(python="python", jobs=args.jobs,
                                                scratch="TMP")
        result["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, check=True,
                                          capture_output=True, text=True).stdout.strip()
        for layer in args.layer:
            layer_started = time.perf_counter()
            mutations = list_mutations(cosmic_ray, clone, LAYERS[layer])
            spans = {m: get_annotation_spans(clone / m) for m in LAYERS[layer]}
            equivalent = [m for m in mutations if is_in_annotation(m, spans[m["module_path"]])]
            candidates = [m for m in mutations if m not in equivalent]
            chosen = candidates
            if args.sample is not None and args.sample < len(candidates):
                chosen = sorted(random.Random(args.seed).sample(candidates, args.sample),
                                key=candidates.index)
            killed, survivors, not_run = 0, [], len(candidates) - len(chosen)
            for index, mutation in enumerate(chosen, 1):
                if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                    not_run += len(chosen) - index + 1
                    break
                outcome = run_one(cosmic_ray, clone, mutation, command, args.timeout_s)
                where = f"{mutation['module_path']}:{mutation['start_pos'][0]} " \
                        f"({mutation['definition_name']})"
                status = outcome.get("test_outcome")
                print(f"[{index}/{len(chosen)}] {status:<11} {where} "
                      f"{mutation['operator_name']}", flush=True)
                if status == "killed":
                    killed += 1
                elif status == "survived":
                    diff = [line for line in outcome.get("diff", "").splitlines()
                            if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]
                    survivors.append({"id": get_id(mutation), "where": where, "diff": diff,
                                      "status": "unclassified"})
                else:
                    survivors.append({"id": get_id(mutation), "where": where,
                                      "status": f"not judged: {status}",
                                      "output": outcome.get("output", "")[-300:]})
            result["layers"][layer] = {
                "command": result["command"], "commit": result["commit"],
                "seconds": round(time.perf_counter() - layer_started, 1),
                "sample_seed": args.seed if args.sample is not None else None,
                "modules": LAYERS[layer], "mutants": len(mutations),
                "equivalent_annotations": len(equivalent), "run": killed + len(survivors),
                "not_run": not_run, "killed": killed,
                "non_equivalent": killed + len(survivors), "survivors": survivors,
            }
            print(f"{layer}: {killed} killed of {killed + len(survivors)} run "
                  f"({len(equivalent)} in annotations, {not_run} not run)")
    result["seconds"] = round(time.perf_counter() - started, 1)
    if args.out:
        path = Path(args.out) / f"mutation-{time.strftime('%Y%m%d')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():  # one file per day: the layers run today join the earlier ones
            earlier = json.loads(path.read_text())
            for layer in earlier["layers"].values():
                layer.setdefault("command", earlier.get("command"))
                layer.setdefault("commit", earlier.get("commit"))
            earlier["layers"].update(result["layers"])
            earlier["seconds"] = round(earlier.get("seconds", 0) + result["seconds"], 1)
            result = {**earlier, "tool": result["tool"]}
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
