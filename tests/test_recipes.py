"""ARCHITECTURE.md's first recipe, proved: an invariant added by editing one file, its
family's module in ``spec/invariants/``, is checked by every tier that checks invariants.

The project is copied to a temporary folder (``overlap_spec/`` and its links to the
package folders), one throwaway invariant is appended to ``spec/invariants/rp.py`` and
nothing else is edited. A process run on the copy then shows it in every tier:

- ``overlap-spec invariants`` lists it, with its claim, source and its one cell;
- ``overlap-spec review`` (the Hypothesis tier, the corpus's witnesses replayed first)
  exercises it in that cell and passes it, and no other cell checks it;
- the exhaustive tier counts its witnesses; the differential tier passes, the reference it
  holds gpu_impl to checking it (gpu_impl itself is held to the reference's state);
- the trace checker judges it on a recorded trace of a witness;
- the proofs tier reports it n/a in Z3 with the reason (nothing in ``proofs/`` encodes
  it), never as proved;
- the witness corpus check names it as neither claimed nor n/a: the recipe's
  ``overlap-spec witnesses --write``, a command and not an edit, is still to run.

The same claim made always false fails the review naming its ID, and the trace checker
finds it in the saved counterexample's trace. The upstream tier reads the same registry
(``harness/conformance/tier.py``) but needs sglang's environment: not run here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("spec", "reference", "gpu_impl", "proofs", "upstream", "harness")
FAMILY_FILE = Path("spec/invariants/rp.py")
CELL = "ov-p1-none-overshoot"  # the one cell with overshoot and no speculation
OTHER_CELL = "ov-p1-none"

THROWAWAY = '''

@invariant("RP11", overshoot=True, is_spec=False)
def check_rp11(config: ModelConfig, obs: Observation) -> int:
    """a request holding KV has a pool row

    Every request holding KV has its row of req_to_token: true by what holding KV means, a
    throwaway claim that tests/test_recipes.py adds to show one file is enough.

    Source: schedule_batch.py ``Req.req_pool_idx``.
    """
    for r in obs.get_holding():
        if FALSE or r.req_pool_idx is None:
            raise fail("RP11", obs, f"for request r{r.rid}: holds KV, req_pool_idx="
                       f"{r.req_pool_idx}")
    return len(obs.get_holding())
'''

# Runs on the copy, in one process (the CLI's own main, then what no command exposes).
DRIVER = r'''
import json, sys
from pathlib import Path
from overlap_spec.harness.cli import main
from overlap_spec.spec.invariants import get_invariant

out, cell, other, negative = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
found = {"registered_from": get_invariant("RP11").check.__code__.co_filename}
from overlap_spec.harness.trace.check import check_trace_file, record_script_trace
if negative:
    found["review"] = main(["review", "--cells", cell, "-j", "1", "-q", "--out", str(out),
                            "--json", str(out / "review.json")])
    traces = sorted(out.rglob("*.trace.ndjson"))
    found["traces"] = [check_trace_file(trace).invariant_id for trace in traces]
    print(json.dumps(found))
    sys.exit(0)
import torch
from overlap_spec.harness.differential.compare import DifferentialPair
from overlap_spec.harness.drive.script import Script
from overlap_spec.harness.drive.witness import check_cell_corpus, load_plan
from overlap_spec.spec.config import PRESETS, ModelConfig, get_cell
from overlap_spec.spec.invariants import INVARIANT_IDS

commands = {
    "invariants": ["invariants", "--json", str(out / "invariants.json")],
    "review": ["review", "--cells", f"{cell},{other}", "-j", "1", "-q", "--out", str(out),
               "--json", str(out / "review.json")],
    "exhaust": ["exhaust", "--cells", cell, "--depth", "2", "-j", "1", "-q",
                "--json", str(out / "exhaust.json")],
    "diff": ["diff", "--cells", cell, "--device", "cpu", "--profile", "quick", "-q",
             "--out", str(out)],
    "prove": ["prove", "--cells", cell, "--no-bmc", "-j", "1", "--quiet",
              "--json", str(out / "prove.json")],
}
for name, argv in commands.items():
    found[name] = main(argv)
config = ModelConfig(get_cell(cell), PRESETS["minimal"])
witness = load_plan(config).witnesses[0]
pair = DifferentialPair(config, device=torch.device("cpu"))
outcomes = [pair.apply(op) for op in witness.ops]
found["differential"] = {"ok": all(o.ok for o in outcomes),
                         "exercised": pair.checker.exercised.get("RP11", 0)}
trace = record_script_trace(Script.for_config(config, list(witness.ops)), out / "w.trace.ndjson")
found["trace"] = {"status": trace.status, "exercised": trace.exercised.get("RP11", 0)}
found["corpus"] = check_cell_corpus(config)
found["ids"] = list(INVARIANT_IDS)
print(json.dumps(found))
'''


def _copy_with_throwaway(tmp_path: Path, always_false: bool) -> Path:
    """The project's packages copied (links as the repository has them), one file edited."""
    copy = tmp_path / "project"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, copy / package, ignore=ignore)
    shutil.copytree(ROOT / "overlap_spec", copy / "overlap_spec", symlinks=True, ignore=ignore)
    family = copy / FAMILY_FILE
    family.write_text(family.read_text()
                      + THROWAWAY.replace("FALSE", "True" if always_false else "False"))
    edited = [p.relative_to(copy) for p in copy.rglob("*")
              if p.is_file() and not p.is_symlink()
              and p.read_bytes() != (ROOT / p.relative_to(copy)).read_bytes()]
    assert edited == [FAMILY_FILE]  # the recipe's claim: one file
    return copy


def _run_driver(copy: Path, always_false: bool) -> dict[str, Any]:
    out = copy / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(copy), OVERLAP_SPEC_OUT=str(out))
    done = subprocess.run([sys.executable, "-c", DRIVER, str(out), CELL, OTHER_CELL,
                           "1" if always_false else "0"], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    # Loaded from the copy (through its overlap_spec/spec link), not from this tree.
    assert Path(found["registered_from"]).resolve() == (copy / FAMILY_FILE).resolve()
    found["stdout"] = done.stdout
    return found


# Five commands on a copy of the project in a fresh process, about 12 s of CPU: ``slow``,
# and .ci/run runs it (its step of the default tier's long tests). The default tier keeps
# the same copy and one-file edit failing review and the trace checker by its ID (below).
@pytest.mark.slow
def test_an_invariant_added_in_one_file_is_checked_by_every_tier(tmp_path: Path) -> None:
    copy = _copy_with_throwaway(tmp_path, always_false=False)
    found = _run_driver(copy, always_false=False)
    out = copy / "out"
    ids = found["ids"]  # its family's last (RX follows RP), the ranges read from the registry
    assert ids.index("RP11") == ids.index("RP10") + 1 and ids[-1].startswith("RX")
    listed = json.loads((out / "invariants.json").read_text())
    assert "RP1-RP11" in listed["ranges"]
    entry = next(inv for inv in listed["invariants"] if inv["id"] == "RP11")
    assert entry["claim"] == "a request holding KV has a pool row"
    assert entry["source"] == "schedule_batch.py ``Req.req_pool_idx``"
    assert entry["cells"] == [CELL] and entry["applies"] == "cells with overshoot and not is_spec"

    assert found["review"] == 0, found["stdout"]
    review = json.loads((out / "review.json").read_text())
    verdicts = review["invariants"]["RP11"]
    assert {v for c, v in verdicts.items() if c.startswith(f"{CELL}@")} == {"pass"}
    assert {v for c, v in verdicts.items() if c.startswith(f"{OTHER_CELL}@")} == {"n/a"}
    assert review["details"][f"{CELL}@minimal"]["exercised"]["RP11"] > 0
    assert "RP11" not in review["details"][f"{OTHER_CELL}@minimal"]["exercised"]

    assert found["exhaust"] == 0
    exhaust = json.loads((out / "exhaust.json").read_text())["cells"][f"{CELL}@minimal"]
    assert exhaust["witnesses"]["RP11"] > 0 and exhaust["verdict"] == "pass"
    assert found["diff"] == 0
    assert found["differential"]["ok"] and found["differential"]["exercised"] > 0
    assert found["trace"] == {"status": "ok", "exercised": found["trace"]["exercised"]}
    assert found["trace"]["exercised"] > 0

    assert found["prove"] == 0
    prove = json.loads((out / "prove.json").read_text())
    assert "RP11" not in {row["invariant"] for row in prove["cells"][CELL]}
    assert prove["not_encoded"][CELL]["RP11"].startswith("no row without the BMC")

    assert found["corpus"] == [f"{CELL}@minimal: RP11 applies but is neither claimed nor n/a"]


def test_an_added_invariant_that_is_false_fails_the_run_naming_it(tmp_path: Path) -> None:
    copy = _copy_with_throwaway(tmp_path, always_false=True)
    found = _run_driver(copy, always_false=True)
    assert found["review"] == 1, found["stdout"]
    review = json.loads((copy / "out" / "review.json").read_text())
    failed = review["details"][f"{CELL}@minimal"]
    assert failed["failed"][0] == "RP11" and failed["violation"].startswith("RP11 violated")
    assert failed["trace"] == "violation"  # the trace checker finds it in the saved trace
    assert found["traces"] and set(found["traces"]) == {"RP11"}  # each size set's trace
    assert review["invariants"]["RP11"][f"{CELL}@minimal"] == "fail"


def test_every_hand_written_id_is_a_registered_invariant() -> None:
    """What cannot come from the registry is written by hand, keyed by ID: the trace's call
    subsets, the plot's bounds, the upstream tier's unjudged IDs and findings, the catalogue,
    the Z3 claims. Each names only registered IDs, so a renamed or retired one fails here."""
    from overlap_spec.harness.catalogue import BUGS
    from overlap_spec.harness.conformance.findings import KNOWN_FINDINGS, UPSTREAM_CHECKER_ID
    from overlap_spec.harness.trace.bounds import BOUNDS
    from overlap_spec.harness.trace.format import (
        CALL_INVARIANTS,
        RACE_INVARIANTS,
        STATE_CALL_INVARIANTS,
    )
    from overlap_spec.proofs.claims import POINT_INVARIANTS, STATE_INVARIANTS
    from overlap_spec.spec.invariants import INVARIANT_IDS
    from overlap_spec.upstream.fields import NOT_JUDGED_ON_RELEASE

    tables: dict[str, set[str]] = {
        "harness/trace/format.py CALL_INVARIANTS": set(CALL_INVARIANTS),
        "harness/trace/format.py STATE_CALL_INVARIANTS": set(STATE_CALL_INVARIANTS),
        "harness/trace/format.py RACE_INVARIANTS": set(RACE_INVARIANTS),
        "harness/trace/bounds.py BOUNDS": set(BOUNDS),
        "upstream/fields.py NOT_JUDGED_ON_RELEASE": set(NOT_JUDGED_ON_RELEASE),
        "harness/conformance/findings.py KNOWN_FINDINGS": {
            i for known in KNOWN_FINDINGS for i in (known.invariant, *(a for a, _ in known.also))
        } - {UPSTREAM_CHECKER_ID},  # upstream's own SchedulerInvariantChecker, not a spec ID
        "harness/catalogue.py BUGS": {i for bug in BUGS for i in bug.invariants},
        "proofs/claims.py": {inv.id for inv in (*STATE_INVARIANTS, *POINT_INVARIANTS)
                             if not inv.id.startswith("IND")},
    }
    for where, ids in tables.items():
        assert ids and ids <= set(INVARIANT_IDS), f"{where}: {sorted(ids - set(INVARIANT_IDS))}"


def test_every_id_literal_in_the_code_is_a_registered_invariant() -> None:
    """Beyond the tables: an ID written as a string anywhere in the packages (a special case
    in the witness search, the BMC's checks, a proof row) names a registered invariant."""
    import ast
    import re

    from overlap_spec.spec.invariants import INVARIANT_IDS
    from overlap_spec.spec.invariants.registry import FAMILIES

    shape = re.compile(rf"(?:{'|'.join(FAMILIES)})[0-9]+")
    unknown = sorted(
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}"
        for package in PACKAGES for path in (ROOT / package).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and shape.fullmatch(node.value) and node.value not in INVARIANT_IDS)
    assert not unknown, unknown


def _expand(listed: str) -> set[str]:
    """``KV1, KV4–KV7`` -> {KV1, KV4, KV5, KV6, KV7}: a list of IDs as the docs write it."""
    ids: set[str] = set()
    for part in listed.split(", "):
        first, _, last = part.partition("–")
        family = first.rstrip("0123456789")
        low = int(first[len(family):])
        high = int(last[len(family):]) if last else low
        ids |= {f"{family}{n}" for n in range(low, high + 1)}
    return ids


def test_the_trace_format_doc_lists_the_call_subsets_of_the_code() -> None:
    """docs/trace-format.md names the invariants a shim's call event is checked with: the
    same as harness/trace/format.py's tuples (a new ID in them must be named there too)."""
    import re

    from overlap_spec.harness.trace.format import CALL_INVARIANTS, STATE_CALL_INVARIANTS

    doc = " ".join((ROOT / "docs" / "trace-format.md").read_text().split())
    calls = re.search(r"\(`CALL_INVARIANTS`: ([^)]*)\)", doc)
    state = re.search(r"\(`STATE_CALL_INVARIANTS`: (.*?), where", doc)
    assert calls and state
    assert _expand(calls[1]) == set(CALL_INVARIANTS)
    assert _expand(state[1]) == set(STATE_CALL_INVARIANTS)
