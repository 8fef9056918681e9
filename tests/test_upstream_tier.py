"""The upstream tier on sglang 0.5.23 itself (marked ``upstream``: ``./dev upstream test``).

Each real ``Scheduler`` needs its own process, so every check here runs the CLI in a
subprocess. The broken copies are the release with one mechanism removed, placed first
via ``--sglang-src``: each must fail the tier with the invariant that mechanism protects.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.upstream

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
needs_sglang = pytest.mark.skipif(
    not HAS_SGLANG, reason="sglang 0.5.23 is not installed here (build it with ./dev upstream)")
REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [p for p in [full_env.get("PYTHONPATH", ""), str(REPO)] if p])
    module = "overlap_spec.harness.conformance.cli"
    return subprocess.run([sys.executable, "-W", "ignore", "-m", module, *args],
                          capture_output=True, text=True, env=full_env, timeout=1200,
                          check=False, cwd=REPO)


def get_release_dir() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


def make_broken_copy(root: Path, relative: str, old: str, new: str) -> Path:
    """The installed release, hard-linked into ``root/sglang``, with one file edited."""
    tree = root / "tree"
    shutil.copytree(get_release_dir(), tree / "sglang", copy_function=os.link,
                    ignore=shutil.ignore_patterns("__pycache__"))
    target = tree / "sglang" / relative
    text = target.read_text()
    assert text.count(old) == 1, f"{relative}: the text to break is not there exactly once"
    target.unlink()  # a new inode: the release's own file stays intact
    target.write_text(text.replace(old, new))
    return tree


# A breakage the default seed's search no longer reaches gets a seed that does (the search
# is seeded; its draws moved with the pause rule, 2026-11-29): the retraction while a
# verify flies, caught at seeds 1 and 3, missed at 2 and at the default.
BREAKAGE_SEEDS: dict[str, int] = {"retracted-row-committed": 1}
# name: (file, old text, new text, cell, invariants); no file: the release's env toggle.
BREAKAGES: dict[str, tuple[str | None, str, str, str, set[str]]] = {
    # The spec-v2 result path no longer skips a request retracted while its verify flew.
    "retracted-row-committed": (
        "srt/managers/scheduler_components/batch_result_processor.py",
        "            if req.is_retracted or req.finished():\n",
        "            if req.finished():\n",
        "ov-p1-v2chain-cpu-honest", {"RP1", "KV5"}),
    # The decode reserve without its double buffer: one draft+verify ahead, not two.
    "reserve-halved": (
        "srt/mem_cache/allocation_sizing.py",
        "    return 2 * get_alloc_len_per_decode()\n",
        "    return get_alloc_len_per_decode()\n",
        "ov-p1-v2chain-cpu-honest", {"KV3"}),
    # release_kv_cache forgets the over-allocated tail past owned_kv_len (a leak).
    "release-leaks-tail": (
        "srt/mem_cache/common.py",
        "    _release_overallocated_kv_indices(\n"
        "        req, owned_kv_len, req.kv.kv_allocated_len, tree_cache\n"
        "    )\n",
        "",
        "ov-p4-v2chain-cpu-honest", {"KV7", "UC"}),
    # The relay skips the stash after a prefill: the first decode gathers a row its owner
    # never wrote (a previous owner's token, or nothing).
    "prefill-token-not-relayed": (
        "srt/managers/scheduler.py",
        "        self.future_map.stash(future_indices, payload)\n"
        "        self.beam_coordinator.maybe_select_and_relay(\n",
        "        if not batch.forward_mode.is_extend():\n"
        "            self.future_map.stash(future_indices, payload)\n"
        "        self.beam_coordinator.maybe_select_and_relay(\n",
        "ov-p1-none", {"FM4", "FM5"}),
    # A stale verify row (its request finished or retracted while it flew) is counted in
    # the request's own spec metrics.
    "stale-row-counts-a-verify": (
        "srt/managers/scheduler_components/batch_result_processor.py",
        "                # kv_committed_len already holds the committed prefix.\n"
        "                pass\n",
        "                # kv_committed_len already holds the committed prefix.\n"
        "                req.spec_verify_ct += 1\n",
        "ov-p1-v2chain-cpu-honest", {"RP6"}),
    # The non-spec decode gathers its input token from the wrong relay buffer (the
    # published seq_lens + 1, indexed the same way): the forward runs on a token nobody
    # sampled, and the next output is not the environment's.
    "input-token-from-the-wrong-buffer": (
        "srt/managers/overlap_utils.py",
        "        batch.input_ids = future_map.output_tokens_buf[batch.req_pool_indices]\n",
        "        batch.input_ids = future_map.new_seq_lens_buf[batch.req_pool_indices]\n",
        "ov-p1-none", {"RP7"}),
    # owned_kv_len no longer cuts at the visible output: the tokens a finishing verify
    # committed past the stop or the cap are cached (B11, and KV9 as restated).
    "owned-kv-len-uncut": (
        "srt/managers/schedule_batch.py",
        "        if self.finished_len is None:\n            return self.kv.kv_committed_len\n",
        "        if True:\n            return self.kv.kv_committed_len\n",
        "ov-p1-v2chain-cpu-honest", {"KV9"}),
    # release_kv_cache no longer gives the request's req_to_token row back: KV7 sees the row
    # held by nobody, KV1 the released request's lengths read off a row it no longer owns
    # (the first the default seed meets); the release's own idle check (_check_req_pool)
    # sees it at the idle point (test_the_releases_idle_checks_run_and_can_fail isolates it).
    "release-keeps-the-row": (
        "srt/mem_cache/common.py",
        "    tree_cache.req_to_token_pool.free(req)\n",
        "",
        "ov-p1-none", {"KV1", "KV7", "UC"}),
    # A stop token accepted past max_new_tokens is no longer demoted to a length finish.
    # RP2 sees the long output as U5 (listed); RP5 sees the wrong reason.
    "stop-past-the-cap-kept": (
        "srt/managers/schedule_batch.py",
        "        if self.finished_len is not None and self.finished_len > max_new_tokens:\n",
        "        if False:\n",
        "ov-p1-v2chain-cpu-honest", {"RP5"}),
    # ForwardBatch.init_new no longer back-fills the lazy seq_lens_sum (PR #25818's seed
    # bug): a decode's ForwardBatch carries None beside its seq_lens_cpu (SL1).
    "init-new-leaves-the-sum-unset": (
        "srt/model_executor/forward_batch_info.py",
        "        if batch.seq_lens_sum is None and seq_lens_cpu is not None:\n"
        "            batch.seq_lens_sum = int(seq_lens_cpu.sum())\n",
        "",
        "ov-p1-none", {"SL1"}),
    # The draft-extend's +D_tok lands on the ScheduleBatch too (#26020's bug). In a cell
    # without the host mirror SL2 has no seq_lens_cpu to compare, so SL10 alone sees it.
    "draft-extend-lengths-on-the-batch": (
        "srt/speculative/eagle_worker_common.py",
        "    forward_batch.seq_lens = (\n"
        "        post_seq_lens if fused_lengths else forward_batch.seq_lens + num_draft_tokens\n"
        "    )\n",
        "    batch.seq_lens = forward_batch.seq_lens = (\n"
        "        post_seq_lens if fused_lengths else forward_batch.seq_lens + num_draft_tokens\n"
        "    )\n",
        "ov-p1-v2chain-nocpu-honest", {"SL10"}),
    # #26972 reverted with the release's own toggle (debug_utils/pr_fix_toggle.py, applied
    # in Scheduler.__init__ before the pools are built), not an edited copy: a page-4 tree's
    # row keeps 4 + D_tok columns past the context (32), and its first decode reserves
    # ceil4(1 + 2A) = 36. The release asserts in eagle_prepare_for_decode (a crash of the
    # loop); a row the assert let through would be KV1 (B21).
    "row-not-widened": (
        None, "SGLANG_DEBUG_REVERT_PR", "26972", "ov-p4-v2tree-cpu-honest", {"KV1", "crash"}),
}
# The release's row assert (speculative/eagle_utils.py eagle_prepare_for_decode), as the
# tier reports the crash of the loop.
ROW_ASSERT = ("crash: sglang raised AssertionError: spec v2 page>1 topk>1 draft "
              "over-allocation (36) exceeds req_to_token row width (32)")


def break_release(root: Path, relative: str | None, old: str, new: str
                  ) -> tuple[list[str], dict[str, str], Path | None]:
    """A breakage's ``check`` arguments, environment and tree: an edited copy of the release
    (``--sglang-src``), or, with no file, the release under its own toggle ``old=new``."""
    env = dict(os.environ)
    if relative is None:
        env[old] = new
        return [], env, None
    tree = make_broken_copy(root, relative, old, new)
    return ["--sglang-src", str(tree)], env, tree


@needs_sglang
def test_release_passes_with_listed_findings(tmp_path: Path) -> None:
    report_path = tmp_path / "r.json"
    done = run_cli("check", "--cells", "ov-p1-none,ov-p4-v2chain-cpu-honest,nov-p1-none",
                   "--json", str(report_path), "--out", str(tmp_path), "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    assert report["ok"] is True and report["version"] == 1
    assert report["sglang"]["version"] == "0.5.23"
    for cell in ("ov-p1-none", "ov-p4-v2chain-cpu-honest", "nov-p1-none"):
        entry = report["cells"][cell]
        assert entry["verdict"] == "pass"
        assert "vacuous" not in entry["invariants"].values()
        # Every example ended at an idle point, where the release's idle checks ran clean.
        idle = entry["idle"]
        assert idle["verdict"] == "pass" and idle["not_reached"] == 0, idle
        assert idle["points"] > 0 and idle["checks_ran"] >= idle["points"], idle
        diff = report["differential"]["cells"][cell]
        assert diff["verdict"] == "pass"
        assert diff["operations_agreed"] > 0
        # Every kind of operation was compared (until 2026-11-27 the differential never
        # drove an abort: its machine's admitted list stayed empty).
        # The witnesses replayed first may pause and resume the release (the search does not).
        assert {"admit", "iterate", "abort"} <= set(diff["operations_by_kind"]) <= {
            "admit", "iterate", "abort", "pauseretract", "continue"}
        assert sum(diff["operations_by_kind"].values()) == diff["operations_agreed"]
        assert diff["stopped"] == {}
    cells = report["differential"]["cells"]
    assert cells["ov-p1-none"]["processed_early"] > 0  # between two prefills
    assert cells["nov-p1-none"]["processed_early"] == 0  # no overlap: nothing to process
    assert cells["ov-p4-v2chain-cpu-honest"]["reference_faults"] == ["B14", "B17", "B4"]
    # A1-A11 are retired: the reference does what the release does, and the release's own
    # ForwardBatch.init_new back-fills seq_lens_sum as the reference's does (A4).
    assert report["differential"]["allowed"] == []
    assert all(not cells[cell]["explained"] for cell in cells), cells
    # SL1 and SL10 are judged on the release (its init_new, its prepare_for_draft_extend).
    assert "SL1" not in report["not_applicable"] and "SL10" not in report["not_applicable"]
    for cell in ("ov-p1-none", "ov-p4-v2chain-cpu-honest", "nov-p1-none"):
        assert report["cells"][cell]["invariants"]["SL1"] == "pass"
        assert report["cells"][cell]["exercised"]["SL1"] > 0
    assert report["cells"]["ov-p4-v2chain-cpu-honest"]["invariants"]["SL10"] == "pass"
    assert report["cells"]["ov-p4-v2chain-cpu-honest"]["exercised"]["SL10"] > 0
    listed = {f["id"] for f in report["findings"] if f["listed"]}
    assert "U3" in listed and "U1" not in listed  # U1 retired: SL4 skips emptied batches
    assert all(f["listed"] for f in report["findings"])
    # U6 (RP5: an abort's last verify shows tokens past the cap) is found here at some
    # seeds only (not since the pause rule joined the machine, 2026-11-29); its
    # deterministic replay is test_an_abort_in_the_verify_that_holds_a_stop_shows_tokens_past_
    # the_stop below. Whatever is found is listed.
    assert listed <= {"U3", "U5", "U6"}, listed
    # Every finding carries a minimised script that reproduces it on the release.
    spec_finding = next(f for f in report["findings"] if f["id"] == "U3")
    # ... and says which sglang it was seen on (the release: no commit).
    seen_on = json.loads(Path(spec_finding["script"]).read_text())["seen_on"]
    assert seen_on["version"] == "0.5.23" and seen_on["source"] == "release"
    assert report["sglang"]["commit"] is None and report["cannot_drive"] == []
    replay = run_cli("replay", spec_finding["script"])
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "listed finding U3" in replay.stdout


@needs_sglang
@pytest.mark.parametrize("name", sorted(BREAKAGES))
def test_broken_copy_fails_with_the_right_invariant(tmp_path: Path, name: str) -> None:
    relative, old, new, cell, expected = BREAKAGES[name]
    source, env, tree = break_release(tmp_path, relative, old, new)
    report_path = tmp_path / "r.json"
    seed = ["--seed", str(BREAKAGE_SEEDS[name])] if name in BREAKAGE_SEEDS else []
    done = run_cli("check", "--cells", cell, *source, *seed, "--json",
                   str(report_path), "--out", str(tmp_path), "-q", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    if tree is not None:
        assert report["sglang"]["source"] == str(tree / "sglang")
    new_ids = {f["invariant"] for f in report["findings"] if not f["listed"]}
    if "crash" in expected and not new_ids:
        # The release crashed in the run: the cell fails with the crash as its reason, and
        # the tier keeps no script after a crash (the scheduler is dead).
        result = report["cells"][cell]
        assert report["ok"] is False and result["verdict"] == "fail"
        assert "the release crashed" in result["reason"], result["reason"]
        assert "exceeds req_to_token row width" in result["reason"], result["reason"]
        return
    assert new_ids & expected, (new_ids, report["cells"][cell])
    new_finding = next(f for f in report["findings"] if not f["listed"])
    assert new_finding["script"] and Path(new_finding["script"]).exists()
    assert new_finding["expected"].startswith(new_finding["invariant"])
    # The saved script replays the finding on the broken tree, and not on the release.
    replay = run_cli("replay", new_finding["script"], *source, env=env)
    assert replay.returncode == 1 and new_finding["invariant"] in replay.stdout, replay.stdout
    release = run_cli("replay", new_finding["script"])
    assert release.returncode == 0, release.stdout + release.stderr


@needs_sglang
def test_a_row_not_widened_crashes_the_release_on_its_row_assert(tmp_path: Path) -> None:
    """B21 on the release: under SGLANG_DEBUG_REVERT_PR=26972 the stand-in's row is sized
    from the reverted get_req_to_token_extra_context_len (24 + 8 = 32 columns) and a
    one-token prompt's first decode trips the release's own assert (36 > 32); without the
    toggle the same script runs clean on the 59-column row."""
    iterate = {"op": "iterate", "allow_prefill": True, "retract": 0, "accept_lens": [1, 1, 1],
               "eos_positions": [], "disable_overlap": False, "spec_steps": 0, "eos_offset": 0}
    script = tmp_path / "row.json"
    script.write_text(json.dumps({
        "version": 1, "cell": "ov-p4-v2tree-cpu-honest", "preset": "minimal", "sizes": {},
        "faults": [], "seed": None, "implementation": "upstream",
        "ops": [{"op": "admit", "prompt_len": 1, "max_new_tokens": 8}] + [iterate] * 4}))
    relative, name, value, _, _ = BREAKAGES["row-not-widened"]
    _, env, _ = break_release(tmp_path, relative, name, value)
    reverted = run_cli("replay", str(script), env=env)
    assert reverted.returncode == 1, reverted.stdout + reverted.stderr
    assert ROW_ASSERT in reverted.stdout and "eagle_utils.py" in reverted.stdout, \
        reverted.stdout
    assert "Traceback" not in reverted.stdout + reverted.stderr
    release = run_cli("replay", str(script))
    assert release.returncode == 0, release.stdout + release.stderr
    assert "no violation outside the listed findings" in release.stdout, release.stdout


@needs_sglang
def test_an_abort_in_the_verify_that_holds_a_stop_shows_tokens_past_the_stop(
        tmp_path: Path) -> None:
    """U6 without the cap: the stop token ends the run at 3 tokens, the abort promoted by
    the same result leaves finished_len unset, and the client sees all 5 (RP2 cannot see
    it: 5 is within max_new_tokens=8). The reference shows the environment's 3."""
    def iterate(**changes: object) -> dict[str, object]:
        return {"op": "iterate", "allow_prefill": False, "retract": 0, "accept_lens": [4, 4, 4],
                "eos_positions": [], "disable_overlap": False, "spec_steps": 0,
                "eos_offset": 0, **changes}
    ops = [{"op": "admit", "prompt_len": 1, "max_new_tokens": 8},
           iterate(allow_prefill=True), iterate(eos_positions=[0], eos_offset=2),
           {"op": "abort", "request": 0}, iterate()]
    script = tmp_path / "u6.json"
    script.write_text(json.dumps({"version": 1, "cell": "ov-p1-v2chain-cpu-honest",
                                  "preset": "minimal", "faults": [], "seed": None,
                                  "implementation": "upstream", "ops": ops}))
    replay = run_cli("replay", str(script))
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert ("listed finding U6 (RP5)" in replay.stdout
            and "finished (abort) with 5 visible output tokens, the environment ended it "
            "(abort) with 3" in replay.stdout), replay.stdout


@needs_sglang
def test_copy_first_on_pythonpath_is_the_one_driven(tmp_path: Path) -> None:
    relative, old, new, cell, expected = BREAKAGES["reserve-halved"]
    assert relative is not None
    tree = make_broken_copy(tmp_path, relative, old, new)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    report_path = tmp_path / "r.json"
    done = run_cli("check", "--cells", cell, "--json", str(report_path), "--out",
                   str(tmp_path), "-q", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    assert report["sglang"]["source"] == str(tree / "sglang")
    # The differential sees the smaller reserve as an unexplained kv_allocated_len.
    divergences = report["differential"]["cells"][cell]["divergences"]
    assert divergences and divergences[0]["field"].endswith("kv_allocated_len")


@needs_sglang
@pytest.mark.parametrize("case", ["missing", "not-a-tree"])
def test_bad_sglang_input_exits_2_with_one_line(tmp_path: Path, case: str) -> None:
    env = dict(os.environ)
    args = ["check", "--cells", "ov-p1-none", "-q"]
    if case == "missing":
        args += ["--sglang-src", str(tmp_path / "nowhere")]
    elif case == "not-a-tree":
        args += ["--sglang-src", str(tmp_path)]
    done = run_cli(*args, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [x for x in done.stderr.splitlines() if x.strip() and not x.startswith("[20")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    expected = {"missing": "no such directory", "not-a-tree": "not an SGLang tree"}[case]
    assert expected in lines[0]


def make_fake_sglang(root: Path, version: str, scheduler: str) -> Path:
    """A package called sglang with a scheduler module of the given text."""
    fake = root / "fake" / "sglang"
    (fake / "srt" / "managers").mkdir(parents=True)
    (fake / "srt" / "__init__.py").write_text("")
    (fake / "srt" / "managers" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (fake / "srt" / "managers" / "scheduler.py").write_text(scheduler)
    return fake.parent


def assert_cannot_drive(done: subprocess.CompletedProcess[str], report_path: Path,
                        cells: list[str], hook: str, change: str) -> dict[str, Any]:
    """Exit 3, every cell saying it cannot drive this sglang at ``hook``, no traceback,
    and the JSON report saying the same."""
    assert done.returncode == 3, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    said = [x.strip() for x in done.stdout.splitlines()
            if x.strip().startswith("cannot drive this sglang:")]
    assert len(said) == len(cells), done.stdout
    assert all(x.startswith(f"cannot drive this sglang: {hook}: ") and change in x
               for x in said), done.stdout
    report = json.loads(report_path.read_text())
    assert report["ok"] is False
    assert [m["hook"] for m in report["cannot_drive"]] == [hook]
    assert {report["cells"][c]["verdict"] for c in cells} == {"cannot-drive"}
    assert "CANNOT DRIVE" in done.stdout
    return report


@needs_sglang
@pytest.mark.parametrize("case", ["wrong-version", "import-fails"])
def test_an_sglang_that_does_not_import_or_is_another_release_exits_3(
        tmp_path: Path, case: str) -> None:
    env = dict(os.environ)
    report_path = tmp_path / "r.json"
    args = ["check", "--cells", "ov-p1-none,nov-p1-none", "-q", "--json", str(report_path),
            "--out", str(tmp_path / "out")]
    if case == "wrong-version":
        env["PYTHONPATH"] = str(make_fake_sglang(tmp_path, "0.4.0", ""))
        hook, change = "sglang version", "sglang 0.4.0 is installed"
    else:
        tree = make_fake_sglang(tmp_path, "0.5.23", "import sglang_missing_dependency\n")
        args += ["--sglang-src", str(tree)]
        hook, change = "import sglang", "sglang does not import: ModuleNotFoundError"
    done = run_cli(*args, env=env)
    report = assert_cannot_drive(done, report_path, ["ov-p1-none", "nov-p1-none"], hook,
                                 change)
    if case == "import-fails":  # the version is the tree's own, read without importing it
        assert report["sglang"]["version"] == "0.5.23"
        assert report["sglang"]["source"] == str(tree / "sglang")


@needs_sglang
def test_a_renamed_private_method_is_named_and_exits_3(tmp_path: Path) -> None:
    """A copy of the release with ``Scheduler._add_request_to_queue`` renamed: no cell runs,
    each says which name is gone (until the compat check, an AttributeError and exit 1);
    ``upstream compat`` lists it as missing. The copy sits in a git checkout with its own
    version: the report names that version and the commit, not the installed release."""
    tree = make_broken_copy(tmp_path, "srt/managers/scheduler.py",
                            "    def _add_request_to_queue(self, req: Req, ",
                            "    def _add_request_to_queue_renamed(self, req: Req, ")
    version_file = tree / "sglang" / "_version.py"
    text = version_file.read_text()
    version_file.unlink()
    version_file.write_text(text.replace("'0.5.23'", "'0.5.24.dev7'"))
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-C", str(tree)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "copy"], check=True)
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    report_path = tmp_path / "r.json"
    cells = ["ov-p1-none", "ov-p4-v2chain-cpu-honest"]
    done = run_cli("check", "--cells", ",".join(cells), "--sglang-src", str(tree), "-q",
                   "--json", str(report_path), "--out", str(tmp_path / "out"))
    report = assert_cannot_drive(done, report_path, cells, "Scheduler._add_request_to_queue",
                                 "missing")
    assert report["sglang"]["version"] == "0.5.24.dev7"
    assert report["sglang"]["commit"] == commit and report["sglang"]["modified"] is False
    assert f"sglang 0.5.24.dev7 at commit {commit}" in done.stdout
    compat = run_cli("compat", "--sglang-src", str(tree))
    assert compat.returncode == 3, compat.stdout + compat.stderr
    rows = {x.split()[0]: x for x in compat.stdout.splitlines() if x.strip()}
    assert "MISSING" in rows["Scheduler._add_request_to_queue"]
    assert rows["Scheduler.run_batch"].split()[2] == "ok"
    assert "1 missing or changed" in compat.stdout


@needs_sglang
def test_a_changed_signature_exits_3(tmp_path: Path) -> None:
    """``Scheduler.update_running_batch`` grows a parameter: the hook passes arguments by
    position, so the tier refuses the tree rather than guess."""
    tree = make_broken_copy(
        tmp_path, "srt/managers/scheduler.py",
        "    def update_running_batch(self, batch: ScheduleBatch) -> Optional[ScheduleBatch]:",
        "    def update_running_batch(self, batch: ScheduleBatch, budget: int = 0)"
        " -> Optional[ScheduleBatch]:")
    report_path = tmp_path / "r.json"
    done = run_cli("check", "--cells", "ov-p1-none", "--sglang-src", str(tree), "-q",
                   "--json", str(report_path), "--out", str(tmp_path / "out"))
    assert_cannot_drive(done, report_path, ["ov-p1-none"], "Scheduler.update_running_batch",
                        "signature changed: now (self, batch, budget=)")


@needs_sglang
def test_the_release_has_every_name_the_tier_relies_on() -> None:
    done = run_cli("compat")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sglang 0.5.23 (release)" in done.stdout
    assert "names present as the tier expects" in done.stdout
    assert "MISSING" not in done.stdout and "CHANGED" not in done.stdout


PATCH_PROBE = """
import importlib, json, sys, types
from overlap_spec.upstream.bootstrap import load_sglang
load_sglang()
from overlap_spec.spec.config import MINIMAL, ModelConfig, get_cell
from overlap_spec.upstream.compat import NEEDS
def snapshot():
    seen = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("sglang") or not isinstance(module, types.ModuleType):
            continue
        for key, value in list(vars(module).items()):
            seen[(id(module), key)] = (value, name + ":" + key)
            if isinstance(value, type) and value.__module__ == name:
                for attr, item in list(vars(value).items()):
                    seen[(id(value), attr)] = (item, name + ":" + key + "." + attr)
    return seen
listed = set()
for need in NEEDS:
    if not need.name:
        continue
    parent = importlib.import_module(need.module)
    *path, last = need.name.split(".")
    for part in path:
        parent = getattr(parent, part)
    listed.add((id(parent), last))
from overlap_spec.upstream.session import get_session
before = snapshot()
get_session(ModelConfig(get_cell(sys.argv[1]), MINIMAL))
after = snapshot()
changed = [(key, label) for key, (value, label) in before.items()
           if key in after and after[key][0] is not value]
print(json.dumps({"changed": sorted(label for _, label in changed),
                  "unlisted": sorted(label for key, label in changed if key not in listed)}))
"""


@needs_sglang
@pytest.mark.parametrize("cell", ["ov-p1-none", "ov-p4-v2tree-cpu-honest"])
def test_every_name_a_session_patches_is_in_the_compat_list(cell: str) -> None:
    """What building a session replaced or wrapped in sglang's modules and classes (found
    by comparing them before and after) is in upstream/compat.py's list: a new patch
    cannot go unlisted."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in [env.get("PYTHONPATH", ""), str(REPO)] if p])
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", PATCH_PROBE, cell],
                          capture_output=True, text=True, env=env, timeout=600, check=False,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    # The probe sees the patches (it cannot come back empty by mistake).
    assert "sglang.srt.managers.scheduler:Scheduler.process_batch_result" in found["changed"]
    assert "sglang.srt.mem_cache.kv_cache_builder:build_kv_cache" in found["changed"]
    unlisted = [x for x in found["unlisted"] if x not in RELEASE_OWN_STATE]
    assert unlisted == [], unlisted


# What 0.5.23 changes itself while a scheduler is built (its process groups, backend
# choices, counters; read off the probe): not patches of the tier.
RELEASE_OWN_STATE: frozenset[str] = frozenset({
    "sglang.kernels.ops.mamba.triton_ops.ssu_dispatch:_mamba_ssu_backend",
    "sglang.srt.distributed.bootstrap:_PARALLEL_INITIALISED",
    "sglang.srt.distributed.device_communicators.custom_all_reduce_utils:"
    "gpu_p2p_access_check",
    *(f"sglang.srt.distributed.parallel_state:{name}" for name in (
        "_ATTN_CP", "_ATTN_TP", "_MOE_DP", "_MOE_EP", "_MOE_TP", "_PP", "_SELF_PP", "_TP",
        "_WORLD")),
    "sglang.srt.layers.quantization.fp4_utils:FP4_GEMM_RUNNER_BACKEND",
    "sglang.srt.layers.quantization.fp8_utils:FP8_GEMM_RUNNER_BACKEND",
    "sglang.srt.layers.quantization.unquant:_BF16_GEMM_BACKEND",
    "sglang.srt.mem_cache.radix_cache:TreeNode.counter",
    "sglang.srt.utils.common:_allowed_media_domains",
    "sglang.srt.utils.common:_media_url_max_file_size_bytes",
})


UPSTREAM_CHECKER_PROBE = """
import json
from overlap_spec.spec.config import MINIMAL, ModelConfig, get_cell
from overlap_spec.spec.state import IterationChoices
from overlap_spec.upstream.adapter import UpstreamScheduler

class Listener:
    def __init__(self):
        self.messages = []
    def __call__(self, obs):
        pass
    def on_upstream_check(self, message, step_index):
        self.messages.append(message)

listener = Listener()
model = UpstreamScheduler(ModelConfig(get_cell("ov-p1-none"), MINIMAL), frozenset(), listener)
model.admit(3, 6)
for _ in range(3):
    model.run_iteration(IterationChoices(allow_prefill=True))
clean = list(listener.messages)
model.scheduler.token_to_kv_pool_allocator.alloc(1)  # a slot nobody owns: a leak
model.run_iteration(IterationChoices(allow_prefill=True))
print(json.dumps({"clean": clean, "after": listener.messages[len(clean):]}))
"""


@needs_sglang
def test_upstreams_own_checker_runs_and_can_fail() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", UPSTREAM_CHECKER_PROBE],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["clean"] and all(m is None for m in result["clean"])
    assert result["after"] and "Leak" in (result["after"][-1] or "")


IDLE_CHECK_PROBE = """
import json
import sys
from overlap_spec.spec.config import MINIMAL, ModelConfig, get_cell
from overlap_spec.spec.state import IterationChoices
from overlap_spec.upstream.adapter import UpstreamScheduler

class Listener:  # the release's own checks only: no invariant of the spec's runs
    def __init__(self):
        self.busy, self.idle = [], []
    def __call__(self, obs):
        pass
    def on_upstream_check(self, message, step_index):
        self.busy.append(message)
    def on_upstream_idle_check(self, message, step_index):
        self.idle.append(message)

listener = Listener()
model = UpstreamScheduler(ModelConfig(get_cell(sys.argv[1]), MINIMAL), frozenset(), listener)
for _ in range(2):  # two requests of one prompt family: a radix cell shares the prefix
    model.admit(6, 3, family=0)
for _ in range(40):  # the tier's idle point: default iterations until on_idle has checked
    model.run_iteration(IterationChoices())
    if model.idle_checks_ran:
        break
print(json.dumps({"busy": listener.busy, "idle": listener.idle}))
"""

# name: (file, old text, new text, cell, what the release's idle check says; None: nothing)
IDLE_BREAKAGES: dict[str, tuple[str, str, str, str, str | None]] = {
    # The row is never given back: only the idle check counts rows (_check_req_pool).
    "release-keeps-the-row": (
        "srt/mem_cache/common.py", "    tree_cache.req_to_token_pool.free(req)\n", "",
        "ov-p1-none", "req_to_token_pool memory leak detected"),
    "release-keeps-the-row-radix": (
        "srt/mem_cache/common.py", "    tree_cache.req_to_token_pool.free(req)\n", "",
        "ov-p1-none-radix", "req_to_token_pool memory leak detected"),
    # The request's pages are never freed at its release (the tree is off here): the last
    # release happens with no batch left, where the busy check does not run.
    "release-frees-no-pages": (
        "srt/mem_cache/common.py",
        "    tree_cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, owned_kv_len)])\n",
        "", "ov-p1-none", "pool memory leak detected! [full]"),
    # A lock left behind at the release is not what the idle check sees: the locked node's
    # pages count as protected, and available + evictable + protected still equals the
    # pool. RX2 sees it (RADIX_BREAKAGES, checkpoint-keeps-its-old-lock).
    "release-keeps-its-lock": (
        "srt/mem_cache/common.py", "    tree_cache.unlock(req.lock)\n", "",
        "ov-p1-none-radix", None),
}


def run_idle_probe(cell: str, tree: Path | None) -> dict[str, list[str | None]]:
    path = [str(REPO)] if tree is None else [str(tree), str(REPO)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", IDLE_CHECK_PROBE, cell],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, list[str | None]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@needs_sglang
@pytest.mark.parametrize("cell", ["ov-p1-none", "ov-p1-none-radix"])
def test_the_releases_idle_checks_run_clean_on_the_release(cell: str) -> None:
    """The idle point reaches on_idle with the scheduler fully idle, once, and the release's
    idle-time checks pass there (the busy check ran before it, clean)."""
    result = run_idle_probe(cell, None)
    assert result["idle"] == [None], result
    assert result["busy"] and all(m is None for m in result["busy"]), result


@needs_sglang
@pytest.mark.parametrize("name", sorted(IDLE_BREAKAGES))
def test_the_releases_idle_checks_run_and_can_fail(tmp_path: Path, name: str) -> None:
    """A broken copy of the release: its idle-time check, reached at the idle point, names
    the leak the busy check did not see (or, for a lock left behind, says nothing: a claim
    about what that check covers)."""
    relative, old, new, cell, expected = IDLE_BREAKAGES[name]
    tree = make_broken_copy(tmp_path, relative, old, new)
    result = run_idle_probe(cell, tree)
    assert all(m is None for m in result["busy"]), result
    if expected is None:
        assert result["idle"] == [None], result
    else:
        assert len(result["idle"]) == 1 and expected in (result["idle"][0] or ""), result


def test_an_idle_check_failure_is_uc_at_idle_and_stops_the_run() -> None:
    """What the tier's checker does with the release's idle-time checks: a pass counts as
    UC and as an idle check; a failure raises UC, says it was at idle, and (being no listed
    finding) is a new one, whose script Hypothesis shrinks and the tier saves."""
    from overlap_spec.harness.conformance.tier import IDLE_CHECK_KEY, UpstreamChecker
    from overlap_spec.spec.config import MINIMAL, ModelConfig, get_cell
    from overlap_spec.spec.invariants import InvariantViolation

    checker = UpstreamChecker(ModelConfig(get_cell("ov-p1-none"), MINIMAL))
    checker.on_upstream_idle_check(None, 3)
    assert checker.exercised[IDLE_CHECK_KEY] == 1 and checker.exercised["UC"] == 1
    with pytest.raises(InvariantViolation) as raised:
        checker.on_upstream_idle_check("req_to_token_pool memory leak detected!", 7)
    assert raised.value.invariant_id == "UC"
    assert "at idle (on_idle): req_to_token_pool memory leak detected!" in str(raised.value)
    assert "op 7" in str(raised.value)


ADMISSION_PROBE = """
import json
import sys
from array import array
from overlap_spec.spec.config import MINIMAL, ModelConfig, get_cell
from overlap_spec.spec.transitions import compute_admission
from overlap_spec.upstream.adapter import UpstreamScheduler

rows = []
for cell in sys.argv[1:]:  # one cell: upstream allows one Scheduler per process
    config = ModelConfig(get_cell(cell), MINIMAL)
    sched = UpstreamScheduler(config, frozenset(), None).scheduler  # loads sglang first
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.utils import validate_input_length
    from sglang.srt.sampling.sampling_params import SamplingParams
    for prompt in range(1, MINIMAL.max_context_len):
        for requested in (1, 4, MINIMAL.max_new_tokens, 30):
            params = SamplingParams(max_new_tokens=requested, temperature=0.0)
            params.normalize(None)
            req = Req("x", "", array("q", [7] * prompt), params, vocab_size=1000)
            sched.init_req_max_new_tokens(req)
            refused = validate_input_length(req, sched.max_req_input_len, False) is not None
            release = [int(req.sampling_params.max_new_tokens), refused]
            spec = list(compute_admission(prompt, requested, MINIMAL.max_context_len,
                                          MINIMAL.kv_tokens, config.page_size))
            rows.append([cell, prompt, requested, release, spec])
print(json.dumps(rows))
"""


@needs_sglang
def test_the_admission_rule_is_the_releases_for_every_prompt_length() -> None:
    """spec.transitions.compute_admission against the release's init_req_max_new_tokens
    and validate_input_length, on the adapter's scheduler (whose max_req_len and
    max_req_input_len follow tp_worker.py), for every prompt below the context length."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    rows = []
    for cell in ("ov-p1-none", "ov-p4-none"):
        done = subprocess.run([sys.executable, "-W", "ignore", "-c", ADMISSION_PROBE, cell],
                              capture_output=True, text=True, env=env, timeout=300,
                              check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * 23 * 4
    assert [r for r in rows if r[3] != r[4]] == []
    assert any(r[3][1] for r in rows) and any(0 < r[3][0] < r[2] for r in rows)


RADIX_PROBE = """
import json
import sys
from overlap_spec.harness.drive.script import Admit, Iterate, Script, apply_op
from overlap_spec.spec.invariants import get_invariant
from overlap_spec.spec.state import IterationChoices
from overlap_spec.upstream.adapter import make_upstream

iterate = Iterate(IterationChoices(allow_prefill=True, accept_lens=(4, 4, 4)))
ops = [Admit(5, 3), iterate, Admit(4, 1), iterate, Admit(5, 8)] + [iterate] * 10
config = Script(sys.argv[1], "minimal", ops, ()).get_config()
seen = []
model = make_upstream(config, frozenset(), seen.append)
admitted = []
for op in ops:
    apply_op(model, op, admitted)
with_tree = [o for o in seen if o.allocator.tree_pages and any(r.holds_kv for r in o.requests)]
last = seen[-1]
print(json.dumps({"keyed": [[r.cached_len, r.inserted_len] for r in last.requests],
                  "tree_pages": len(last.allocator.tree_pages),
                  "kv7_with_a_live_request": len(with_tree),
                  "kv9": get_invariant("KV9").check(config, last)}))
"""


@needs_sglang
@pytest.mark.parametrize(("cell", "keyed", "tree_pages"), [
    ("ov-p4-none", [[7, 4], [4, 4], [12, 12]], 5),  # floor4(cached)
    ("ov-p4-v2chain-cpu-honest", [[8, 4], [4, 0], [13, 12]], 4),  # floor4(cached - 1)
])
def test_the_releases_own_tree_keys_what_the_sink_keeps(cell: str, keyed: list[list[int]],
                                                        tree_pages: int) -> None:
    """With ``--radix-force-miss``'s switch the release runs its own radix tree, every match
    a miss: at each finish it keys the whole pages of the cached length, one short under
    EAGLE, as compute_inserted_len (and the reference's sink, tests/test_tree_cut.py) says;
    KV7 sees its unlocked pages beside a live request's, KV9 judges what it keyed."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OVERLAP_SPEC_UPSTREAM_RADIX_FORCE_MISS="1")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", RADIX_PROBE, cell],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["keyed"] == keyed
    assert result["tree_pages"] == tree_pages
    assert result["kv7_with_a_live_request"] > 0 and result["kv9"] == 3


@needs_sglang
def test_the_radix_force_miss_run_passes(tmp_path: Path) -> None:
    """``upstream check --radix-force-miss``: the tier on the release's own tree passes,
    its report saying the tree was on."""
    done = run_cli("check", "--radix-force-miss", "--cells", "ov-p4-v2chain-nocpu-honest",
                   "--profile", "quick", "--out", str(tmp_path), "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "with the release's radix tree on, every match forced to miss" in done.stdout


@needs_sglang
def test_a_refused_and_a_capped_prompt_agree_with_the_release(tmp_path: Path) -> None:
    """The release queues a refused prompt as one token with a deferred abort; the
    reference and the release agree op by op on it and on a capped request."""
    for cell, accept in (("ov-p1-none", 1), ("ov-p1-v2chain-cpu-honest", 4)):
        iterate = {"op": "iterate", "allow_prefill": True, "retract": 0,
                   "accept_lens": [accept] * 3, "eos_positions": [], "disable_overlap": False,
                   "spec_steps": 0, "eos_offset": 0}
        ops = [{"op": "admit", "prompt_len": 20, "max_new_tokens": 8},
               {"op": "admit", "prompt_len": 16, "max_new_tokens": 8}] + [iterate] * 8
        script = tmp_path / f"admission-{cell}.json"
        script.write_text(json.dumps({"version": 1, "cell": cell, "preset": "minimal",
                                      "faults": [], "seed": None,
                                      "implementation": "upstream-differential",
                                      "ops": ops}))
        replay = run_cli("replay", str(script))
        assert replay.returncode == 0, replay.stdout + replay.stderr
        assert "replayed 10 of 10 ops" in replay.stdout, replay.stdout
        assert "no unexplained divergence" in replay.stdout, replay.stdout


def run_server(tmp_path: Path, cells: str, *extra: str,
               stdin: str | None = None) -> list[dict[str, object]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in [env.get("PYTHONPATH", ""), str(REPO)] if p])
    done = subprocess.run([sys.executable, "-W", "ignore", "-m",
                           "overlap_spec.harness.conformance.server", "--cells", cells,
                           "--out", str(tmp_path), "--profile", "quick", "--jobs", "2", *extra],
                          capture_output=True, text=True, env=env, timeout=600, check=False,
                          cwd=REPO, input=stdin)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@needs_sglang
@pytest.mark.parametrize("fork", [True, False], ids=["forked", "fresh-interpreters"])
def test_cell_server_reports_every_cell_and_a_crash_as_a_crash(tmp_path: Path,
                                                               fork: bool) -> None:
    # A cell the tier does not know exits 2 in its process: reported with its exit status
    # and its last line, never as a result; the real cell after it runs as usual.
    events = run_server(tmp_path, "no-such-cell,ov-p1-none", *([] if fork else ["--no-fork"]))
    assert events[0]["event"] == "sglang" and events[0]["version"] == "0.5.23"
    done = {e["cell"]: e for e in events if e["event"] == "done"}
    assert set(done) == {"no-such-cell", "ov-p1-none"}
    assert done["no-such-cell"]["exit"] == 2 and "no-such-cell" in str(
        done["no-such-cell"]["reason"])
    assert not (tmp_path / "no-such-cell.json").exists()
    assert done["ov-p1-none"]["exit"] == 0 and done["ov-p1-none"]["reason"] is None
    result = json.loads((tmp_path / "ov-p1-none.json").read_text())
    assert result["verdict"] == "pass" and result["runs"] > 0


@needs_sglang
@pytest.mark.parametrize("told", ["go\n", ""], ids=["go", "end-of-input"])
def test_a_waiting_cell_server_runs_its_cells_only_when_told(tmp_path: Path, told: str) -> None:
    # check starts the server before its first tier (--wait): it imports and probes a
    # scheduler build, then runs the cells on "go"; without it (the driver is gone or
    # stopped), nothing runs and it exits 0.
    events = run_server(tmp_path, "ov-p1-none", "--wait", stdin=told)
    assert events[0]["event"] == "sglang"
    done = {e["cell"]: e for e in events if e["event"] == "done"}
    if told:
        assert done["ov-p1-none"]["exit"] == 0, done
        assert json.loads((tmp_path / "ov-p1-none.json").read_text())["verdict"] == "pass"
    else:
        assert [e["event"] for e in events] == ["sglang"]
        assert not (tmp_path / "ov-p1-none.json").exists()


@needs_sglang
def test_the_out_of_memory_abort_of_the_last_request_agrees_with_the_release(
        tmp_path: Path) -> None:
    """A request whose next decode alone outgrows a 12-token pool: the release's
    retract_decode aborts it (#19881) and the reference does the same, op by op (status,
    reason, output, committed and allocated lengths, free pages), with and without
    overlap; the spec's invariants hold on the release's run."""
    iterate = {"op": "iterate", "allow_prefill": True, "retract": 0, "accept_lens": [1, 1, 1],
               "eos_positions": [], "disable_overlap": False, "spec_steps": 0, "eos_offset": 0}
    ops = [{"op": "admit", "prompt_len": 5, "max_new_tokens": 8}] + [iterate] * 5
    for cell in ("ov-p1-v2chain-cpu-honest", "nov-p1-v2chain-cpu-honest"):
        for implementation in ("upstream-differential", "upstream"):
            script = tmp_path / f"oom-{cell}-{implementation}.json"
            script.write_text(json.dumps({
                "version": 1, "cell": cell, "preset": "minimal", "sizes": {"kv_tokens": 12},
                "faults": [], "seed": None, "implementation": implementation, "ops": ops}))
            replay = run_cli("replay", str(script))
            assert replay.returncode == 0, replay.stdout + replay.stderr
            assert f"{cell}@minimal[kv_tokens=12]" in replay.stdout, replay.stdout
            if implementation == "upstream-differential":
                assert "replayed 6 of 6 ops" in replay.stdout, replay.stdout
                assert "no unexplained divergence" in replay.stdout, replay.stdout
            else:
                assert "no violation outside the listed findings" in replay.stdout, replay.stdout


@needs_sglang
def test_the_b25_kill_sizes_abort_a_one_token_prompt_on_the_release(tmp_path: Path) -> None:
    """B25's kill sizes (``Bug.sizes``): a one-token prompt's first decode already asks more
    than the pool (1 + 2A = 13 > 12 with chain steps 5 or three branches). The release
    aborts the request there, and the clean reference agrees op by op: the mutant's crash
    stands where the release's own path is the abort."""
    from overlap_spec.harness.catalogue import get_bug
    from overlap_spec.harness.drive.cells import format_sizes
    from overlap_spec.harness.drive.script import Script, op_from_json, run_script

    sizes = dict(get_bug("B25").sizes)
    iterate = {"op": "iterate", "allow_prefill": True, "retract": 0, "accept_lens": [1, 1, 1],
               "eos_positions": [], "disable_overlap": False, "spec_steps": 0, "eos_offset": 0}
    ops = [{"op": "admit", "prompt_len": 1, "max_new_tokens": 8}] + [iterate] * 3
    for cell in ("ov-p1-v2tree-cpu-honest", "nov-p1-v2chain-cpu-honest"):
        script = tmp_path / f"b25-{cell}.json"
        script.write_text(json.dumps({
            "version": 1, "cell": cell, "preset": "minimal", "sizes": sizes, "faults": [],
            "seed": None, "implementation": "upstream-differential", "ops": ops}))
        replay = run_cli("replay", str(script))
        assert replay.returncode == 0, replay.stdout + replay.stderr
        assert f"{cell}@minimal[{format_sizes(sizes)}]" in replay.stdout, replay.stdout
        assert "replayed 4 of 4 ops" in replay.stdout, replay.stdout
        assert "no unexplained divergence" in replay.stdout, replay.stdout
        clean = run_script(Script(cell, "minimal", [op_from_json(op, i) for i, op in
                                                    enumerate(ops)], sizes=sizes))
        assert clean.violation is None
        crashed = run_script(Script(cell, "minimal", [op_from_json(op, i) for i, op in
                                                      enumerate(ops)], ("B25",), sizes=sizes),
                             catch_crash=True)
        expected = get_bug("B25").crash
        assert expected is not None and expected.matches(crashed.crashed), crashed.crash


@needs_sglang
def test_a_prompt_capped_to_zero_new_tokens_agrees_with_the_release(tmp_path: Path) -> None:
    """A prompt of 9 in a 16-token page-4 pool is accepted with max_new_tokens capped to
    0: the release finishes it by length at its prefill with no visible token (finished_len
    0) and, without speculation, never decodes its prefill-only batch. Found by running
    the upstream tier at --sizes kv_tokens=16; the reference agrees op by op."""
    iterate = {"op": "iterate", "allow_prefill": True, "retract": 0, "accept_lens": [1, 1, 1],
               "eos_positions": [], "disable_overlap": False, "spec_steps": 0, "eos_offset": 0}
    ops = [{"op": "admit", "prompt_len": 9, "max_new_tokens": 4}] + [iterate] * 3
    for cell in ("ov-p4-none", "nov-p4-none", "ov-p4-v2chain-cpu-honest"):
        script = tmp_path / f"cap-zero-{cell}.json"
        script.write_text(json.dumps({
            "version": 1, "cell": cell, "preset": "minimal", "sizes": {"kv_tokens": 16},
            "faults": [], "seed": None, "implementation": "upstream-differential",
            "ops": ops}))
        replay = run_cli("replay", str(script))
        assert replay.returncode == 0, replay.stdout + replay.stderr
        assert "replayed 4 of 4 ops" in replay.stdout, replay.stdout
        assert "no unexplained divergence" in replay.stdout, replay.stdout


@needs_sglang
def test_a_page_1_tree_allocates_past_its_row_on_the_release_as_predicted(
        tmp_path: Path) -> None:
    """U7, predicted by KV1 on the reference (tests/test_admission.py), on the release: a
    240-token prompt in a page-1 tree at the realistic preset allocates 269 slots in a
    268-column row, with the reference's numbers. Beside a request on the next row the
    overflow is recorded as U7 and the run is judged no further; on the pool's last row the
    kernel would write past the tensor, which the stand-in reports as a crash."""
    iterate = {"op": "iterate", "allow_prefill": True, "retract": 0, "accept_lens": [1] * 16,
               "eos_positions": [], "disable_overlap": False, "spec_steps": 0, "eos_offset": 0}
    long = {"op": "admit", "prompt_len": 240, "max_new_tokens": 96}
    beside = [{"op": "admit", "prompt_len": 5, "max_new_tokens": 96}, iterate, iterate, long]
    for name, ops in (("beside", beside + [iterate] * 20), ("last-row", [long] + [iterate] * 20)):
        script = tmp_path / f"u7-{name}.json"
        script.write_text(json.dumps({
            "version": 1, "cell": "ov-p1-v2tree-cpu-honest", "preset": "realistic",
            "sizes": {}, "faults": [], "seed": None, "implementation": "upstream",
            "ops": ops}))
        replay = run_cli("replay", str(script))
        if name == "beside":
            assert replay.returncode == 0, replay.stdout + replay.stderr
            assert "listed finding U7 (KV1)" in replay.stdout, replay.stdout
            assert ("kv_committed_len=245, kv_allocated_len=269, row width=268 (allocated "
                    "past the row)") in replay.stdout, replay.stdout
            assert "nothing after it was judged" in replay.stdout, replay.stdout
        else:
            assert replay.returncode == 1, replay.stdout + replay.stderr
            assert "crash: sglang raised IndexError: assign_req_to_token_pool: row 16 " \
                   "columns [268, 269) run past the req_to_token pool" in replay.stdout, \
                replay.stdout
            assert "Traceback" not in replay.stdout + replay.stderr


B17_PROBE = """
import json, sys
from pathlib import Path
from overlap_spec.harness.conformance import tier
from overlap_spec.harness.drive.script import load_script

script = load_script(Path(sys.argv[1]))
compared, with_b17, _ = tier.replay_differential(script)
tier.get_release_faults = lambda cell: frozenset()  # the reference's default: B17 off
_, without, _ = tier.replay_differential(script)
print(json.dumps({"compared": compared, "with": with_b17, "without": without}))
"""


@needs_sglang
def test_an_abort_pending_at_a_verify_that_crosses_the_cap_is_b17_on_the_release(
        tmp_path: Path) -> None:
    """B17 is current upstream, shown op by op: a request aborted while running, then a
    verify accepting 3 tokens against max_new_tokens=2. The release shows all four tokens
    (U5, U6); the reference agrees with it only with B17 switched on, as the differential
    runs it. (Found when the differential first drove aborts, 2026-11-27.)"""
    iterate = {"op": "iterate", "allow_prefill": True, "retract": 0, "accept_lens": [1],
               "eos_positions": [], "disable_overlap": False, "spec_steps": 0, "eos_offset": 0}
    ops = [{"op": "admit", "prompt_len": 1, "max_new_tokens": 2}, iterate,
           {"op": "abort", "request": 0}, {**iterate, "accept_lens": [3, 3, 3]}]
    script = tmp_path / "b17.json"
    script.write_text(json.dumps({
        "version": 1, "cell": "nov-p1-v2tree-cpu-honest", "preset": "minimal", "sizes": {},
        "faults": [], "seed": None, "implementation": "upstream-differential", "ops": ops}))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", B17_PROBE, str(script)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["compared"] == 4 and result["with"] is None, result
    without = result["without"]
    assert without["step"] == 3 and without["field"] == "request r0.output_ids", without
    assert len(eval(without["upstream"])) == 4 and len(eval(without["reference"])) == 2


def check_sized_cells(tmp_path: Path, cells: str, sizes: str, invariant: str) -> Any:
    """``overlap-spec upstream check`` of two cells at ``sizes``: both pass with every
    invariant witnessed (``invariant`` among them) and the differential agrees."""
    report_path = tmp_path / "r.json"
    done = run_cli("check", "--cells", cells, "--sizes", sizes,
                   "--json", str(report_path), "--out", str(tmp_path), "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    assert report["ok"] is True and len(report["cells"]) == 2
    for name, entry in report["cells"].items():
        assert entry["verdict"] == "pass", name
        assert entry["invariants"][invariant] == "pass", name
        assert "vacuous" not in entry["invariants"].values(), name
    for name, diff in report["differential"]["cells"].items():
        assert diff["verdict"] == "pass" and diff["stopped"] == {}, name
    return report


@needs_sglang
def test_the_release_chunking_agrees_with_the_reference(tmp_path: Path) -> None:
    """``chunked_prefill_size=4``: the release chunks the presets' prompts (up to 23 tokens)
    and the reference does the same, op by op, aborts of a chunked request included; every
    invariant, KV12 among them, holds on the release's run with a witness."""
    report = check_sized_cells(tmp_path, "ov-p1-none,nov-p1-v2chain-cpu-honest",
                               "chunked_prefill_size=4", "KV12")
    for name, diff in report["differential"]["cells"].items():
        assert {"admit", "iterate", "abort"} <= set(diff["operations_by_kind"]) <= {
            "admit", "iterate", "abort", "pauseretract", "continue"}, name
    # A prompt of 10 in chunks of 4, aborted with its second chunk scheduled (under overlap
    # still in flight), then a second prompt through all three chunks and its decodes.
    iterate = {"op": "iterate", "allow_prefill": True, "retract": 0, "accept_lens": [1, 1, 1],
               "eos_positions": [], "disable_overlap": False, "spec_steps": 0, "eos_offset": 0}
    ops = ([{"op": "admit", "prompt_len": 10, "max_new_tokens": 3}, iterate, iterate,
            {"op": "abort", "request": 0}, {"op": "admit", "prompt_len": 10,
                                            "max_new_tokens": 3}] + [iterate] * 8)
    for cell in ("ov-p1-none", "nov-p1-v2chain-cpu-honest"):
        script = tmp_path / f"chunks-{cell}.json"
        script.write_text(json.dumps({
            "version": 1, "cell": cell, "preset": "minimal",
            "sizes": {"chunked_prefill_size": 4}, "faults": [], "seed": None,
            "implementation": "upstream-differential", "ops": ops}))
        replay = run_cli("replay", str(script))
        assert replay.returncode == 0, replay.stdout + replay.stderr
        assert f"{cell}@minimal[chunked_prefill_size=4]" in replay.stdout, replay.stdout
        assert f"replayed {len(ops)} of {len(ops)} ops" in replay.stdout, replay.stdout
        assert "no unexplained divergence" in replay.stdout, replay.stdout


MIXED_PROBE = """
import json
import sys
from overlap_spec.harness.drive.cells import make_preset
from overlap_spec.spec.config import ModelConfig, get_cell
from overlap_spec.spec.invariants import INVARIANTS
from overlap_spec.spec.state import IterationChoices, ObservationPoint
from overlap_spec.upstream.adapter import UpstreamScheduler

out = {}
for cell in sys.argv[1:]:  # one cell: upstream allows one Scheduler per process
    config = ModelConfig(get_cell(cell), make_preset(
        "minimal", {"chunked_prefill_size": 4, "mixed_chunk": 1}))
    applying = [inv for inv in INVARIANTS if inv.applies(config.cell)]
    modes, views = [], []

    def observe(obs):
        for inv in applying:
            inv.check(config, obs)
        if obs.point is ObservationPoint.LAUNCH and obs.launch is not None:
            modes.append([obs.launch.forward_mode, [int(m.rid) for m in obs.launch.members],
                          [int(m.write_width) for m in obs.launch.members]])
        if obs.admission is not None:
            views.append([obs.admission.mixed_decode_tokens,
                          None if obs.admission.continued is None
                          else obs.admission.continued[4]])

    model = UpstreamScheduler(config, frozenset(), observe)
    short = model.admit(2, 6)
    rid = model.admit(10, 3)
    committed = []
    for _ in range(12):
        model.run_iteration(IterationChoices(allow_prefill=True))
        committed.append(model.get_observable_state().requests[rid].kv_committed_len)
    out[cell] = {"modes": modes[:5], "views": views, "committed": committed[:4]}
print(json.dumps(out))
"""


@needs_sglang
def test_the_release_mixes_decodes_into_chunks_as_the_reference(tmp_path: Path) -> None:
    """``chunked_prefill_size`` with ``mixed_chunk=1`` (``enable_mixed_chunk``): the release
    launches each chunk of a prompt of 10 with the running decode in one MIXED batch,
    setting one token of the chunk budget aside for it, as the reference does
    (tests/test_chunked_prefill.py ``test_a_decode_rides_in_each_chunk``); and the
    Hypothesis run agrees op by op with every invariant witnessed, RP8 among them, on the
    pool of 16 where prefill-only prompts are common (B19's sizes)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = {}
    for cell in ("ov-p1-none", "nov-p1-none"):
        done = subprocess.run([sys.executable, "-W", "ignore", "-c", MIXED_PROBE, cell],
                              capture_output=True, text=True, env=env, timeout=600,
                              check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        result.update(json.loads(done.stdout.strip().splitlines()[-1]))
    assert set(result) == {"ov-p1-none", "nov-p1-none"}
    for cell, seen in result.items():
        assert seen["committed"] == [2, 5, 8, 10], cell
        assert [m[0] for m in seen["modes"]] == ["extend", "mixed", "mixed", "mixed",
                                                 "decode"], cell
        assert all(m[1] == [1, 0] and m[2] == [0, 1] for m in seen["modes"][1:4]), cell
        assert seen["views"] == [[0, None], [1, 5], [1, 8], [1, 10]], cell
    check_sized_cells(tmp_path, "ov-p1-none,nov-p1-none",
                      "chunked_prefill_size=8,mixed_chunk=1,kv_tokens=16", "RP8")


SPEC_TAIL_PROBE = """
import json
import sys
from overlap_spec.harness.drive.cells import make_preset
from overlap_spec.reference.scheduler import Scheduler
from overlap_spec.spec.config import ModelConfig, get_cell
from overlap_spec.spec.invariants import INVARIANTS
from overlap_spec.spec.state import IterationChoices, ObservationPoint
from overlap_spec.upstream.adapter import UpstreamScheduler

cell = sys.argv[1]
config = ModelConfig(get_cell(cell), make_preset(
    "minimal", {"chunked_prefill_size": 4, "mixed_chunk": 1}))
applying = [inv for inv in INVARIANTS if inv.applies(config.cell)]
out = {}
for name, factory in (("reference", Scheduler), ("release", UpstreamScheduler)):
    modes = []

    def observe(obs):
        for inv in applying:
            inv.check(config, obs)
        if obs.point is ObservationPoint.LAUNCH and obs.launch is not None:
            modes.append(obs.launch.forward_mode)

    model = factory(config, frozenset(), observe)
    short = model.admit(2, 3)
    model.admit(10, 3)
    committed, outputs = [], []
    for _ in range(6):
        model.run_iteration(IterationChoices(allow_prefill=True))
        state = model.get_observable_state().requests[short]
        committed.append(state.kv_committed_len)
        outputs.append(len(state.output_ids))
    state = model.get_observable_state().requests[short]
    out[name] = {"modes": modes[:4], "committed": committed, "outputs": outputs,
                 "cached": state.cached_len, "reason": state.finish_reason}
print(json.dumps(out))
"""


@needs_sglang
def test_the_release_commits_spec_tails_as_the_reference(tmp_path: Path) -> None:
    """Spec's mixed tails (``mixed_chunk=1`` in a spec cell): the release and the reference
    run a prompt of 2 (3 new tokens) beside one of 10 in chunks of 4 step for step alike:
    the same launches (extend, then the short request's decode as a tail of two chunks),
    the same committed lengths (each tail commits its bonus slot unless it finishes the
    request: ``batch_result_processor.py`` ``kv_committed_len += 1``), the same cached
    length at the finish, every invariant holding on both; then a Hypothesis run of two spec
    cells agrees op by op."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for cell in ("nov-p1-v2chain-cpu-honest", "ov-p1-v2chain-cpu-honest"):
        done = subprocess.run([sys.executable, "-W", "ignore", "-c", SPEC_TAIL_PROBE, cell],
                              capture_output=True, text=True, env=env, timeout=600,
                              check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["release"] == result["reference"], (cell, result)
        seen = result["release"]
        assert seen["modes"] == ["extend", "mixed", "mixed", "extend"], cell
        assert seen["reason"] == "length" and seen["cached"] == 3, cell
        assert seen["outputs"][-1] == 3, cell
    # And a Hypothesis run of the spec cells agrees op by op, with only listed findings.
    check_sized_cells(tmp_path, "ov-p1-v2chain-cpu-honest,nov-p1-v2tree-cpu-honest",
                      "chunked_prefill_size=4,mixed_chunk=1", "KV8")


@needs_sglang
def test_page_trees_pass_with_listed_findings(tmp_path: Path) -> None:
    """Trees on pages of 4 (PR 26972), resolved through the triton stand-in: every invariant
    witnessed, KV1 and KV3 at the page-aligned reserve among them, the reference agreeing
    op by op, and nothing outside the findings the page-1 trees show."""
    cells = ("ov-p4-v2tree-cpu-honest", "ov-p4-v2tree-nocpu-honest", "nov-p4-v2tree-cpu-honest")
    report_path = tmp_path / "r.json"
    done = run_cli("check", "--cells", ",".join(cells), "--json", str(report_path), "--out",
                   str(tmp_path), "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    assert report["ok"] is True and set(report["cells"]) == set(cells)
    for cell in cells:
        entry = report["cells"][cell]
        assert entry["verdict"] == "pass", cell
        assert "vacuous" not in entry["invariants"].values(), cell
        assert entry["invariants"]["KV1"] == entry["invariants"]["KV3"] == "pass", cell
        diff = report["differential"]["cells"][cell]
        assert diff["verdict"] == "pass" and diff["stopped"] == {}, cell
    assert {f["id"] for f in report["findings"]} <= {"U3", "U5", "U6"}
    assert all(f["listed"] for f in report["findings"])


@needs_sglang
def test_page_trees_chunk_and_mix_as_the_reference(tmp_path: Path) -> None:
    """Chunked prefill and spec's mixed tails in the page-4 trees with the CPU mirror. At
    chunked_prefill_size=4 a mixed chunk's budget, 4 less one token per running decode
    (schedule_policy.py PrefillAdder.__init__), floors to no page
    (_select_prefill_admission), so no prefill runs beside a decode and KV5 is never
    witnessed (page-4 chains alike); 8 leaves a page."""
    check_sized_cells(tmp_path, "ov-p4-v2tree-cpu-honest,nov-p4-v2tree-cpu-honest",
                      "chunked_prefill_size=8,mixed_chunk=1", "KV8")


GEOMETRY_PROBE = """
import json
from overlap_spec.upstream.bootstrap import load_sglang
load_sglang()
from overlap_spec.harness.drive.cells import make_preset
from overlap_spec.spec.config import ModelConfig, SpecMode, enumerate_cells, get_departures
from overlap_spec.upstream.session import publish_config
from sglang.srt.mem_cache.allocation_sizing import (
    get_alloc_len_per_decode, get_req_to_token_extra_context_len)

rows = []
for preset in ("minimal", "realistic"):
    for cell in enumerate_cells():
        if get_departures(cell):
            continue
        steps = (1, 3, 7) if cell.spec_mode is SpecMode.V2_CHAIN else (None,)
        for chain in steps:
            sizes = {} if chain is None else {"chain_steps": chain}
            config = ModelConfig(cell, make_preset(preset, sizes))
            publish_config(config)  # raises where the model's A or row is not the release's
            rows.append([preset, cell.name, chain, get_alloc_len_per_decode(),
                         get_req_to_token_extra_context_len()])
print(json.dumps(rows))
"""


@needs_sglang
def test_the_models_reserve_and_row_are_the_releases_in_every_driven_cell() -> None:
    """``alloc_len_per_decode`` (A) and ``row_width - max_context_len`` against the release's
    ``get_alloc_len_per_decode()`` and ``get_req_to_token_extra_context_len()``, published
    as the tier publishes each cell (the session refuses a cell where they differ): every
    driven cell at both presets, the chains at 1, 3 and 7 steps. A tree on pages of 4 has
    A = 16 and a row 35 past the context at the minimal shape, 32 and 67 at the realistic."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", GEOMETRY_PROBE],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * (16 + 6 * 2)
    seen = {(r[0], r[1]): (r[3], r[4]) for r in rows if r[2] in (None, 3)}
    assert seen["minimal", "ov-p4-v2tree-cpu-honest"] == (16, 35)
    assert seen["realistic", "nov-p4-v2tree-cpu-honest"] == (32, 67)
    assert seen["realistic", "ov-p1-v2tree-cpu-honest"] == (12, 12)  # U7's row: 256 + 12


DRAFT_PROBE = """
import json
from types import SimpleNamespace
from overlap_spec.upstream.bootstrap import load_sglang
load_sglang()
import torch
from sglang.srt.speculative import eagle_worker_common
from overlap_spec.spec.config import PRESETS, ModelConfig, get_cell
from overlap_spec.spec.transitions import compute_draft_writes


class Pool:
    # The draft pool: move_kv_cache(tgt, src), recorded.
    def __init__(self):
        self.moves = []

    def move_kv_cache(self, tgt, src):
        self.moves += [list(p) for p in zip(tgt.tolist(), src.tolist(), strict=True)]


# prepare_for_draft ends in the draft ForwardBatch, which needs a model runner; what it
# decides about KV (out_cache_loc, the tail copies) is done by then.
eagle_worker_common.ForwardBatch = SimpleNamespace(init_new=lambda *args, **kwargs: None)
out = []
for preset in ("minimal", "realistic"):
    config = ModelConfig(get_cell("ov-p4-v2tree-cpu-honest"), PRESETS[preset])
    shape, page = config.get_shape(), config.page_size
    seq_lens = list(range(1, 4 * page + 1))
    n = len(seq_lens)
    # req_to_token with a distinct slot per (row, position); the batch takes the rows in
    # reverse, so a batch index is not a row.
    table = (torch.arange(n).view(-1, 1) * 10000
             + torch.arange(int(config.row_width)).view(1, -1) + 1)
    indices = torch.arange(n - 1, -1, -1)
    seq = torch.tensor(seq_lens, dtype=torch.int64)
    # The helper alone, on prepare_for_draft's arithmetic (eagle_worker_common.py).
    last_page = seq % page
    alone = Pool()
    eagle_worker_common.duplicate_prefix_tail_to_draft_branches(
        alone, table[indices], seq - last_page, last_page,
        (last_page + shape.steps + page - 1) // page, shape.topk, page)
    # And prepare_for_draft itself: the draft slots and the copies it makes.
    batch = SimpleNamespace(
        forward_mode=SimpleNamespace(is_idle=lambda: False), seq_lens=seq.clone(),
        seq_lens_cpu=None, req_pool_indices=indices, device="cpu", out_cache_loc=None,
        token_to_kv_pool_allocator=SimpleNamespace(page_size=page))
    pool = Pool()
    runner = SimpleNamespace(token_to_kv_pool=pool,
                             spec_algorithm=SimpleNamespace(is_standalone=lambda: False))
    eagle_worker_common.prepare_for_draft(SimpleNamespace(),
                                          SimpleNamespace(req_to_token=table), batch, None,
                                          runner, shape.topk, shape.steps)
    slots, copies = [], []
    for b, s in enumerate(seq_lens):
        row = int(indices[b])
        draft, tail = compute_draft_writes(s, shape, page)
        slots += [int(table[row, p]) for p in draft]
        copies += [[int(table[row, t]), int(table[row, src])] for t, src in tail]
    out.append({"preset": preset, "alone": alone.moves, "copies": pool.moves,
                "slots": batch.out_cache_loc.tolist(), "model": [slots, copies],
                "residues": sorted({s % page for s in seq_lens})})
print(json.dumps(out))
"""


@needs_sglang
def test_the_releases_draft_writes_on_pages_of_4_are_the_models() -> None:
    """``compute_draft_writes`` against the release's own code on CPU, for a batch holding
    every ``seq_len % 4``: ``duplicate_prefix_tail_to_draft_branches`` with a pool that
    records ``move_kv_cache(tgt, src)`` gives the model's tail copies (target, source)
    mapped through each request's row, pair for pair and in order; and
    ``prepare_for_draft`` (its ForwardBatch stubbed) gathers the model's draft slots into
    ``out_cache_loc`` and makes the same copies. Both tree shapes: topk 2, steps 2 and
    topk 4, steps 3."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", DRAFT_PROBE],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["preset"] for r in result] == ["minimal", "realistic"]
    for r in result:
        slots, copies = r["model"]
        assert r["residues"] == [0, 1, 2, 3]
        assert copies and r["alone"] == copies, r["preset"]
        assert r["copies"] == copies and r["slots"] == slots, r["preset"]


LAUNCH_PROBE = """
import json
from overlap_spec.spec.config import MINIMAL, ModelConfig, get_cell
from overlap_spec.spec.invariants import INVARIANTS
from overlap_spec.spec.state import IterationChoices, ObservationPoint
from overlap_spec.upstream.adapter import UpstreamScheduler

config = ModelConfig(get_cell("ov-p4-v2tree-cpu-honest"), MINIMAL)
applying = [inv for inv in INVARIANTS if inv.applies(config.cell)]
widths, faults, rows = {}, [], set()

def observe(obs):
    for inv in applying:
        inv.check(config, obs)
    rows.add(obs.allocator.row_width)
    if obs.point is ObservationPoint.LAUNCH and obs.launch.forward_mode == "decode":
        faults.extend(obs.launch.kv_write_faults)
        for m in obs.launch.members:
            widths.setdefault(m.seq_len % 4, set()).add(int(m.write_width))

model = UpstreamScheduler(config, frozenset(), observe)
for prompt in (1, 2, 3):
    model.admit(prompt, 8)
for accept in (1, 2, 3, 1, 2, 3, 2, 1):
    model.run_iteration(IterationChoices(allow_prefill=True, accept_lens=(accept,) * 3))
print(json.dumps({"widths": {k: sorted(v) for k, v in widths.items()},
                  "faults": len(faults), "rows": sorted(rows)}))
"""


@needs_sglang
def test_a_page_tree_decode_reports_its_holey_width() -> None:
    """The stand-in worker writes the draft's slots and tail copies and the verify window,
    and the LAUNCH reports W by ``seq_len % 4`` (6 for 0-2, 10 for 3 at the minimal shape);
    every invariant holds, no write faults, on the release's 59-column row."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", LAUNCH_PROBE],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["faults"] == 0 and result["rows"] == [59]
    assert result["widths"] == {"0": [6], "1": [6], "2": [6], "3": [10]}, result


@needs_sglang
def test_an_untouched_copy_of_the_release_passes_at_quick_whatever_the_seed(
        tmp_path: Path) -> None:
    """`review --sglang-src` on an untouched copy of 0.5.23, every cell, the quick budget,
    seed 2: the tier replays the witnesses the release can be driven through before its
    search (harness.drive.witness), so RP8, vacuous in every non-speculative cell at that
    seed before them, has a witness, and every witness met its claims on the release."""
    tree = tmp_path / "tree"
    shutil.copytree(get_release_dir(), tree / "sglang", copy_function=os.link,
                    ignore=shutil.ignore_patterns("__pycache__"))
    report_path = tmp_path / "r.json"
    done = run_cli("check", "--sglang-src", str(tree), "--profile", "quick", "--seed", "2",
                   "--json", str(report_path), "--out", str(tmp_path / "out"), "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    assert report["sglang"]["version"] == "0.5.23" and report["sglang"]["commit"] is None
    driven = {c: e for c, e in report["cells"].items() if e["verdict"] != "n/a"}
    assert len(driven) >= 16, sorted(report["cells"])
    for cell, entry in driven.items():
        assert entry["verdict"] == "pass", (cell, entry.get("reason"))
        witnesses = entry["witnesses"]
        # The cells the release serves by default run chunked at the preset's serving size
        # (the report's "sizes"), and replay that size set's corpus.
        sizes = entry.get("sizes")
        expected = ("default" if not sizes else
                    ",".join(f"{name}={value}" for name, value in sorted(sizes.items())))
        assert witnesses["source"] == f"corpus minimal/{expected}.json", (cell, witnesses)
        assert witnesses["ran"] >= 1 and witnesses["lost"] == {}, (cell, witnesses)
        if "-none" in cell:
            assert entry["invariants"]["RP8"] == "pass" and entry["exercised"]["RP8"] > 0


# The radix cells (issue 42): the release's prefix cache on and shared. Each breakage is an
# upstream radix-era bug put back into a copy of 0.5.23; the tier must fail with the RX (or
# KV) invariant that states what it broke.
RADIX_BREAKAGES: dict[str, tuple[str, str, str, str, set[str]]] = {
    # #32170 (b), #40681: the checkpoint takes its new lock without dropping the old one.
    "checkpoint-keeps-its-old-lock": (
        "srt/mem_cache/unified_radix_cache.py",
        "        self.unlock(req.lock)\n        # Opt-in: leave the matched-prefix mamba",
        "        # Opt-in: leave the matched-prefix mamba",
        "ov-p1-none-radix", {"RX2", "RX3"}),
    # #13714 / #11351: a release frees from the start of the row, the tree's prefix too.
    "release-frees-the-prefix": (
        "srt/mem_cache/common.py",
        "    tree_cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, owned_kv_len)])\n",
        "    tree_cache.free_kv_row(req.kv, [(0, owned_kv_len)])\n",
        "ov-p1-none-radix", {"RX1", "KV7", "UC", "crash"}),
    # mini-sglang #142: duplicates freed, the row not repointed at the tree's pages.
    "checkpoint-without-the-repoint": (
        "srt/mem_cache/unified_radix_cache.py",
        "        self.req_to_token_pool.write(\n"
        "            (req.kv.req_pool_idx, slice(req.kv.cache_protected_len, len(new_indices))),\n"
        "            new_indices[req.kv.cache_protected_len :],\n"
        "        )\n",
        "",
        "ov-p1-none-radix", {"RX4", "RX1", "KV4", "KV7", "UC"}),
}


@needs_sglang
@pytest.mark.parametrize("core", ["python", "rust"])
def test_release_passes_in_radix_cells(tmp_path: Path, core: str) -> None:
    """The release with its radix cache on, on either tree core: every RX invariant judged
    and passing, the reference's tree (nodes, locks, sizes, the rows' shared pages) agreeing
    with it, and the idle checks run at every example's end."""
    report_path = tmp_path / "r.json"
    cells = ("ov-p1-none-radix", "ov-p4-v2chain-cpu-honest-radix")
    done = run_cli("check", "--radix", "--tree-core", core, "--cells", ",".join(cells),
                   "--profile", "quick", "--json", str(report_path), "--out", str(tmp_path),
                   "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    assert report["tree_core"] == core
    assert f"on the release's {core} tree core" in done.stdout
    for cell in cells:
        entry = report["cells"][cell]
        assert entry["verdict"] == "pass"
        assert entry["idle"]["verdict"] == "pass" and entry["idle"]["points"] > 0
        for rx in ("RX1", "RX2", "RX3", "RX4", "RX5", "RX6", "RX7"):
            assert entry["invariants"][rx] == "pass" and entry["exercised"][rx] > 0, rx
        diff = report["differential"]["cells"][cell]
        assert diff["verdict"] == "pass" and diff["operations_agreed"] > 0
    # A radix cell's name needs --radix; --radix takes radix cells only.
    for args in (("--cells", "ov-p1-none-radix"), ("--radix", "--cells", "ov-p1-none")):
        refused = run_cli("check", *args, "-q")
        assert refused.returncode == 2 and "--radix" in refused.stderr, refused.stderr


@needs_sglang
@pytest.mark.parametrize("core", ["python", "rust"])
@pytest.mark.parametrize("name", sorted(RADIX_BREAKAGES))
def test_broken_radix_copy_fails_with_the_right_invariant(tmp_path: Path, name: str,
                                                          core: str) -> None:
    """Each breakage sits above the tree core (unified_radix_cache.py, common.py): on the
    Rust core the tier's reading of the tree (upstream.fields.read_rust_tree) must see it
    too."""
    relative, old, new, cell, expected = RADIX_BREAKAGES[name]
    source, env, _ = break_release(tmp_path, relative, old, new)
    report_path = tmp_path / "r.json"
    done = run_cli("check", "--radix", "--tree-core", core, "--cells", cell, *source,
                   "--profile", "quick", "--json", str(report_path), "--out", str(tmp_path),
                   "-q", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    new_ids = {f["invariant"] for f in report["findings"] if not f["listed"]}
    result = report["cells"][cell]
    if not new_ids and "crash" in expected:
        assert "the release crashed" in result.get("reason", ""), result
        return
    assert new_ids & expected, (new_ids, result)


FLUSH_PROBE = """
import json
import sys
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.script import Admit, Iterate, Script, apply_op, get_factory
from overlap_spec.spec.state import IterationChoices

def flushes(implementation):
    config = Script(sys.argv[1], "minimal").get_config()
    checker = InvariantChecker(config)
    model = get_factory(implementation)(config, frozenset(), checker)
    admitted, flushed = [], []
    ops = [Admit(6, 2, family=0), Iterate(IterationChoices(allow_prefill=False))]
    ops += [Iterate(IterationChoices())] * 7
    for index, op in enumerate(ops):
        apply_op(model, op, admitted)
        if index:
            flushed.append(model.flush_cache())
    return {"flushed": flushed, "rx8": checker.exercised["RX8"]}

print(json.dumps({name: flushes(name) for name in ("reference", "upstream")}))
"""


@needs_sglang
@pytest.mark.parametrize("cell", ["ov-p1-none-radix", "nov-p4-v2chain-cpu-honest-radix"])
def test_the_release_flushes_where_the_reference_does(cell: str) -> None:
    """The release's own ``flush_cache`` between iterations: refused while the request
    waits, runs or is in flight, run at the same iteration as the reference's once the
    scheduler is fully idle (after which it stays idle), RX8 judged on what it left."""
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", FLUSH_PROBE, cell],
                          capture_output=True, text=True, env=dict(os.environ,
                                                                   PYTHONPATH=str(REPO)),
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["upstream"] == result["reference"]
    flushed = result["reference"]["flushed"]
    assert flushed[:2] == [False, False] and True in flushed
    assert all(flushed[flushed.index(True):])  # idle stays idle: every later flush runs
    assert result["reference"]["rx8"] == len(flushed) - flushed.index(True)


PAUSE_PROBE = """
import json
import sys
from overlap_spec.harness.drive.checker import InvariantChecker
from overlap_spec.harness.drive.script import (
    Admit, Continue, Flush, Iterate, PauseRetract, Script, apply_op, get_factory)
from overlap_spec.spec.state import IterationChoices

def run(implementation):
    config = Script(sys.argv[1], "minimal").get_config()
    checker = InvariantChecker(config)
    model = get_factory(implementation)(config, frozenset(), checker)
    step = Iterate(IterationChoices())
    ops = [Admit(6, 4), Admit(3, 4), step, step, PauseRetract(), step, Flush(), Continue()]
    ops += [step] * 8
    admitted, states = [], []
    for op in ops:
        apply_op(model, op, admitted)
        state = model.get_observable_state()
        states.append([[r.rid, r.status, len(r.output_ids), r.kv_committed_len,
                        r.kv_allocated_len] for r in state.requests])
    return {"states": states, "rp10": checker.exercised["RP10"]}

print(json.dumps({name: run(name) for name in ("reference", "upstream")}))
"""


@needs_sglang
@pytest.mark.parametrize("cell", ["ov-p1-none", "nov-p4-v2chain-cpu-honest",
                                  "ov-p1-v2chain-cpu-honest-radix"])
def test_the_release_pauses_with_retraction_where_the_reference_does(cell: str) -> None:
    """The release's own ``pause_generation(mode="retract")`` between iterations: both
    requests, prefilled and decoding, back in the waiting queue holding nothing, an
    iteration while paused building nothing, a flush while paused running (the waiting
    queue ignored), and after ``continue_generation`` both re-prefilled and finished, the
    same as the reference's op by op."""
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", PAUSE_PROBE, cell],
                          capture_output=True, text=True, env=dict(os.environ,
                                                                   PYTHONPATH=str(REPO)),
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["upstream"]["states"] == result["reference"]["states"]
    states = result["reference"]["states"]
    assert all(s[1] == "running" for s in states[3])  # both decoding before the pause
    assert all(s[1:] == ["waiting", s[2], 0, 0] and s[2] > 0 for s in states[4])  # retracted
    assert states[5] == states[4]  # paused: nothing built
    assert all(s[1] == "finished" for s in states[-1])
    assert result["reference"]["rp10"] > 0 and result["upstream"]["rp10"] > 0


LOST_ABORT_PROBE = """
import json
from overlap_spec.harness.drive.script import (
    Abort, Admit, Continue, Iterate, PauseRetract, Script, apply_op, get_factory)
from overlap_spec.spec.state import IterationChoices

def run(implementation):
    config = Script("ov-p1-none", "minimal", sizes={"chunked_prefill_size": 4}).get_config()
    model = get_factory(implementation)(config, frozenset(), None)
    idle = Iterate(IterationChoices(allow_prefill=False))
    ops = [Admit(12, 4), Iterate(IterationChoices()), idle, idle, Abort(0), PauseRetract(),
           Continue()] + [Iterate(IterationChoices())] * 8
    admitted = []
    for op in ops:
        apply_op(model, op, admitted)
    return [[r.status, r.finish_reason, len(r.output_ids)]
            for r in model.get_observable_state().requests]

print(json.dumps({name: run(name) for name in ("reference", "upstream")}))
"""


@needs_sglang
def test_the_release_loses_a_chunked_abort_across_a_retract_pause() -> None:
    """Found 2026-11-29 (docs/upstream-pause-retract.md): the chunked request, in no batch in
    flight, is aborted (only ``_pending_chunked_abort_req`` is set) and a retract pause
    follows; the pause re-queues it, the next top drops the marker (no longer chunked, no
    KV), and after ``continue_generation`` the release runs it to its length cap. The
    reference finishes it "abort". Not yet a listed finding: the tier's search draws no
    pause until it is; this pins the release's behaviour so a change to it is seen."""
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", LOST_ABORT_PROBE],
                          capture_output=True, text=True, env=dict(os.environ,
                                                                   PYTHONPATH=str(REPO)),
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["reference"] == [["finished", "abort", 1]]
    assert result["upstream"] == [["finished", "length", 4]]
