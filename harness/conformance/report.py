"""The upstream tier's merged report: built from each cell's result, rendered as the lines
``overlap-spec upstream check`` prints, and turned into a tier of ``check``
(:func:`upstream_tier_report`). The run that produces it is ``harness/conformance/cli.py``."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from overlap_spec.harness.drive.cells import format_sizes
from overlap_spec.harness.verdict import TierReport, Verdict
from overlap_spec.upstream.standins import STAND_INS

CANNOT_DRIVE = "cannot-drive"  # a cell's verdict when the tier cannot drive this sglang


def build_report(results: dict[str, dict[str, Any]], sglang: dict[str, Any],
                 args: argparse.Namespace, elapsed: float,
                 mismatches: list[dict[str, str]] | None = None) -> dict[str, Any]:
    from overlap_spec.harness.conformance.findings import (
        ALLOWED_DIVERGENCES,
        UPSTREAM_NOT_APPLICABLE,
    )
    from overlap_spec.upstream.fields import get_tree_core

    findings = [f for r in results.values() for f in r.get("findings", [])]
    driven = [c for c, r in results.items() if r["verdict"] != "n/a"]
    ok = bool(driven) and all(results[c]["verdict"] == "pass" for c in driven)
    return {
        "version": 1,
        "ok": ok,
        "sglang": {**sglang, "tree": None if args.sglang_src is None else str(args.sglang_src)},
        # What the tier cannot drive in this sglang (upstream/compat.py): no cell ran.
        "cannot_drive": list(mismatches or []),
        "seed": args.seed,
        "profile": args.profile,
        "preset": args.preset,
        **({"tree_core": get_tree_core()} if has_radix_cells(results) else {}),
        **({"sizes": dict(args.sizes)} if getattr(args, "sizes", None) else {}),
        "elapsed_s": round(elapsed, 1),
        "cells": {c: {"verdict": r["verdict"], "reason": r.get("reason"),
                      "invariants": r.get("invariants", {}),
                      "exercised": r.get("exercised", {}), "runs": r.get("runs", 0),
                      **({"sizes": r["sizes"]} if r.get("sizes") else {}),
                      **({"mechanisms": r["mechanisms"]} if "mechanisms" in r else {}),
                      **({"witnesses": r["witnesses"]} if "witnesses" in r else {}),
                      **({"idle": r["idle"]} if "idle" in r else {}),
                      "seconds": r.get("seconds"), "wall_s": r.get("wall_s")}
                  for c, r in results.items()},
        "differential": {
            "cells": {c: r.get("differential", {"verdict": "n/a", "divergences": []})
                      for c, r in results.items()},
            "allowed": [a.to_json() for a in ALLOWED_DIVERGENCES],
        },
        "findings": findings,
        "not_applicable": dict(UPSTREAM_NOT_APPLICABLE),
        "stand_ins": [{"target": x.target, "kind": x.kind, "reason": x.reason}
                      for x in STAND_INS],
    }


def has_radix_cells(cells: Iterable[str]) -> bool:
    from overlap_spec.spec.config import get_cell

    return any(get_cell(cell).radix for cell in cells)


def describe_sglang(sglang: dict[str, Any]) -> str:
    """``sglang 0.5.23 (release)``, ``sglang 0.5.24 at commit abc1234 (modified) (/src)``:
    :meth:`SglangSource.describe` of a report's ``sglang`` entry."""
    from overlap_spec.upstream.bootstrap import SglangSource

    return SglangSource(sglang["version"], sglang["source"], "", sglang.get("commit") or None,
                        bool(sglang.get("modified"))).describe()


def render_report(report: dict[str, Any]) -> str:
    tree = report["sglang"].get("tree")
    replay = "overlap-spec upstream replay {}" + (f" --sglang-src {tree}" if tree else "")
    lines = [f"{describe_sglang(report['sglang'])}, "
             f"seed {report['seed']}, profile {report['profile']}, preset {report['preset']}"
             + (f", sizes {format_sizes(report['sizes'])}" if report.get("sizes") else "")]
    if report["sglang"].get("environment"):
        lines.append(f"driven in {report['sglang']['environment']}")
    from overlap_spec.upstream.fields import is_radix_force_miss

    if is_radix_force_miss():
        lines.append("with the release's radix tree on, every match forced to miss "
                     "(--radix-force-miss): nothing shared")
    from overlap_spec.upstream.fields import get_tree_core

    if has_radix_cells(report["cells"]):
        lines.append(f"the radix cells' tree on the release's {get_tree_core()} tree core"
                     + (" (nodes, locks, pages and sizes read from the core; its keys' "
                        "tokens are not readable: each node's key is what the inserts gave "
                        "its slots)" if get_tree_core() == "rust" else ""))
    width = max(len(c) for c in report["cells"])
    wide = max(7, *(len(r["verdict"]) for r in report["cells"].values()))
    lines.append(f"{'cell':<{width}}  {'verdict':<{wide}}  invariants                 "
                 "differential")
    for cell, r in report["cells"].items():
        inv = r["invariants"]
        counts: dict[str, int] = {}
        for verdict in inv.values():
            counts[verdict] = counts.get(verdict, 0) + 1
        summary = " ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        diff = report["differential"]["cells"][cell]
        diff_text = diff.get("verdict", "n/a")
        if "operations_agreed" in diff:
            aborts = diff.get("operations_by_kind", {}).get("abort", 0)
            diff_text += f" ({diff['operations_agreed']} ops agreed, {aborts} aborts)"
        lines.append(f"{cell:<{width}}  {r['verdict']:<{wide}}  {summary:<25}  {diff_text}")
        if r["verdict"] == CANNOT_DRIVE:
            lines += [f"{'':<{width}}    cannot drive this sglang: {m['hook']}: {m['change']}"
                      for m in report.get("cannot_drive", [])]
        elif r["verdict"] != "pass" and r.get("reason"):
            lines.append(f"{'':<{width}}    {r['reason']}")
    skipped = [c for c, r in report["cells"].items()
               if r.get("idle", {}).get("verdict") == "skipped"]
    if skipped:
        lines.append("the release's idle-time checks (on_idle) never ran, skipped (not a "
                     f"pass): {', '.join(skipped)}")
    sized: dict[str, list[str]] = {}
    for cell, r in report["cells"].items():
        if r.get("sizes") and not report.get("sizes"):
            sized.setdefault(format_sizes(r["sizes"]), []).append(cell)
    for sizes, cells in sized.items():
        lines.append(f"at {sizes} (chunked prefill on, as the release serves its default "
                     f"configuration): {', '.join(cells)}")
    from overlap_spec.harness.drive.witness import group_reasons

    na = group_reasons({cell: r.get("witnesses", {}).get("not_applicable", {})
                        for cell, r in report["cells"].items()})
    if na:
        lines.append("\nn/a for want of a witness the release can be driven through (not a "
                     "pass):")
        lines += [f"  {inv} in {', '.join(cells)}: {why}" for inv, why, cells in na]
    for cell, r in report["cells"].items():
        for index, claims in r.get("witnesses", {}).get("lost", {}).items():
            lines.append(f"\nwitness {index} of {cell} no longer exercises "
                         f"{', '.join(claims)} on this sglang (the reference's run of it "
                         "does; vacuous unless the search reached it)")
    listed: dict[str, list[dict[str, Any]]] = {}
    new = []
    for f in report["findings"]:
        if f["listed"]:
            listed.setdefault(f["id"], []).append(f)
        else:
            new.append(f)
    if listed:
        lines.append("\nlisted upstream findings (docs/upstream-findings.md), seen in:")
        for fid, group in listed.items():
            first = min(group, key=lambda f: f["ops"])
            lines.append(f"  {fid} {first['invariant']}: {', '.join(f['cell'] for f in group)}")
            lines.append(f"     e.g. {first['actual']}")
            lines.append(f"     replay: {replay.format(first['script'])}")
    for f in new:
        lines.append(f"\nNEW upstream finding in {f['cell']}: {f['actual']}")
        if f.get("upstream"):
            lines.append(f"  where sglang was: {f['upstream']}")
        lines.append(f"  the spec expects: {f['expected']}")
        if f.get("script"):
            lines.append(f"  replay: {replay.format(f['script'])}")
    for cell, diff in report["differential"]["cells"].items():
        for div in diff.get("divergences", []):
            lines.append(f"\nunexplained divergence in {cell} at op {div['step']}: "
                         f"{div['field']}: reference {div['reference']}, upstream "
                         f"{div['upstream']}")
            lines.append(f"  replay: {replay.format(div['script'])}")
            if div.get("replays") is False:
                lines.append("  (the saved script alone did not show it again: still a "
                             "failure; the run's own sequence diverged)")
        if diff.get("error"):
            lines.append(f"\ndifferential crashed in {cell}: {diff['error']}")
    driven = [c for c, r in report["cells"].items() if r["verdict"] != "n/a"]
    passed = sum(report["cells"][c]["verdict"] == "pass" for c in driven)
    if report.get("cannot_drive"):
        lines.append(f"\nCANNOT DRIVE {describe_sglang(report['sglang'])}: "
                     f"{len(report['cannot_drive'])} name(s) the tier relies on are missing "
                     "or changed ('overlap-spec upstream compat' lists them); no cell ran, "
                     f"{report['elapsed_s']:.1f}s")
        return "\n".join(lines)
    lines.append(f"\n{'OK' if report['ok'] else 'FAILED'}: {passed}/{len(driven)} driven cells "
                 f"pass ({len(report['cells']) - len(driven)} n/a), {len(new)} new finding(s), "
                 f"{report['elapsed_s']:.1f}s")
    return "\n".join(lines)



def upstream_tier_report(report: dict[str, Any]) -> TierReport:
    """The upstream tier's merged report as a tier of ``check``: cannot-drive when the
    sglang given lacks a name the tier relies on (or does not import), never a pass."""
    if report.get("cannot_drive"):
        first = report["cannot_drive"][0]
        reason = f"cannot drive this sglang: {first['hook']}: {first['change']}"
        return TierReport("upstream", Verdict.CANNOT_DRIVE, "UPSTREAM CANNOT DRIVE SGLANG",
                          {"upstream": report}, reason)
    verdict = Verdict.PASS if report.get("ok") else Verdict.FAIL
    return TierReport("upstream", verdict,
                      "upstream ok" if verdict is Verdict.PASS else "UPSTREAM FAILED",
                      {"upstream": report})


def upstream_tier_error(reason: str) -> TierReport:
    """The tier could not run (a usage error inside ``check``): inconclusive, not a pass."""
    return TierReport("upstream", Verdict.INCONCLUSIVE, "UPSTREAM FAILED",
                      {"upstream": {"status": "error", "ok": False, "reason": reason}}, reason)
