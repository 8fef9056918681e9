"""The upstream tier's cell server: sglang imported once, each cell in a forked process.

Upstream allows one ``Scheduler`` per process, so every cell needs a process of its own;
importing sglang takes about 9 s of the 15 s a short cell costs. This server runs in the
upstream environment, imports sglang (and the tier) once, then forks one child per cell,
``--jobs`` at a time. A forked child starts with everything imported and no scheduler
built, runs :func:`overlap_spec.harness.conformance.tier.main` for its cell, and exits.
Nothing has started a thread when it forks (:func:`main` checks), so the fork is safe.

Building a scheduler imports some 700 more modules (the model registry, kernels); the
first cell's child reports them and the server imports them before it forks the next cell,
so the others start with those loaded too. Should one of those imports start a thread, the
remaining cells run in fresh interpreters instead (slower, never unsafe). With ``--wait``
(how ``overlap-spec check`` starts it, before its first tier) all of that happens at once,
a child probing the first cell's scheduler build, and the cells run only when a line
``go`` arrives on standard input (end of input: exit 0, nothing run).

Protocol: one JSON object per line on standard output, nothing else there:

- ``{"event": "sglang", "version", "source", "commit", "modified"}`` once sglang imported
  and has every name the tier relies on (the preflight, :mod:`upstream.compat`);
- ``{"event": "cannot-drive", "sglang": {...} | null, "mismatches": [{"hook",
  "change"}]}`` and exit 3 when it does not import, is another release than the tier's,
  or lacks a name the tier relies on (or has it with another signature); nothing runs;
- ``{"event": "error", "message"}`` and exit 2 on a usage error (no such tree);
- ``{"event": "start", "cell"}`` and ``{"event": "done", "cell", "exit", "wall_s",
  "reason"}`` per cell; ``exit`` is the child's exit status (negative: killed by that
  signal), ``reason`` the last line of its standard error when it did not exit 0 (or
  the timeout). The cell's result is ``OUT/<cell>.json``, its standard error
  ``OUT/<cell>.stderr``.

SIGINT is ignored here and in the children (the driving process decides); SIGTERM kills
every child and exits. ``python -m overlap_spec.harness.conformance.server --cells A,B
--out DIR [--seed N] [--profile P] [--preset P] [--sglang-src DIR] [--jobs N]
[--timeout S] [--no-fork] [--wait]``; ``--no-fork`` runs each cell in a fresh interpreter, as the
server does by itself once forking is unsafe.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

POLL_S = 0.05


def emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def last_line(path: Path) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines()
                 if x.strip() and not x.startswith("[20")]
    except OSError:
        return "no output"
    return lines[-1] if lines else "no output"


def preload() -> None:
    """Import what a cell imports, so a forked child finds it loaded."""
    import hypothesis  # noqa: F401
    import sglang.srt.mem_cache.memory_pool  # noqa: F401
    import sglang.srt.server_args  # noqa: F401

    import overlap_spec.harness.conformance.tier  # noqa: F401
    import overlap_spec.upstream.adapter  # noqa: F401
    import overlap_spec.upstream.session  # noqa: F401


def _cell_argv(cell: str, args: argparse.Namespace) -> list[str]:
    argv = ["--cell", cell, "--out", str(args.out), "--seed", str(args.seed),
            "--profile", args.profile, "--preset", args.preset]
    share = getattr(args, "shares", {}).get(cell, 1.0)
    if share != 1.0:
        argv += ["--share", repr(share)]
    if args.sizes:
        argv += ["--sizes", args.sizes]
    if args.sglang_src:
        argv += ["--sglang-src", str(args.sglang_src)]
    return argv


def get_shares(cells: list[str], args: argparse.Namespace) -> dict[str, float]:
    """Each cell's share of the tier's sequences a cell: a release cell and its radix twin
    served together split one cell's (``check``'s default run drives both)."""
    from overlap_spec.harness.drive.cells import get_upstream_shares, parse_sizes
    from overlap_spec.spec.config import get_cell

    sizes = parse_sizes(args.sizes) if args.sizes else {}
    known = []
    for name in cells:
        try:
            known.append(get_cell(name))
        except KeyError:  # reported by its own process (exit 2), never a share's crash
            continue
    shares = dict(zip((c.name for c in known),
                      get_upstream_shares(known, args.preset, sizes), strict=True))
    return {name: shares.get(name, 1.0) for name in cells}


def run_child(cell: str, args: argparse.Namespace, report_modules: int | None,
              probe_only: bool = False) -> None:
    """In the forked child: the cell, its output to ``OUT/<cell>.stderr``; exits, never
    returns to the server's loop. With ``report_modules`` (a pipe), the child first builds
    its scheduler and writes the names of the modules that took to import, so the server
    can import them before it forks the other cells; ``probe_only``: then exits (0)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    log = os.open(args.out / f"{cell}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    code = 1
    try:
        if report_modules is not None:
            before = set(sys.modules)
            try:
                from overlap_spec.harness.drive.cells import get_upstream_config, parse_sizes
                from overlap_spec.spec.config import get_cell
                from overlap_spec.upstream.session import get_session

                sizes = parse_sizes(args.sizes) if args.sizes else {}
                get_session(get_upstream_config(get_cell(cell), args.preset, sizes))
            except Exception:  # noqa: BLE001 - the cell itself reports a failed build
                pass
            names = "\n".join(m for m in sys.modules if m not in before)
            with os.fdopen(report_modules, "w") as pipe:
                pipe.write(names)
            if probe_only:
                code = 0
                return
        from overlap_spec.harness.conformance.tier import main as run_tier_cell

        code = run_tier_cell(_cell_argv(cell, args))
    except BaseException:  # noqa: BLE001 - the child reports everything, then exits
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def import_reported(pipe: int) -> None:
    """Import the modules a first cell reported (best effort: one that fails to import
    here is imported, or fails, in each cell as before)."""
    with os.fdopen(pipe) as reader:
        names = [n for n in reader.read().splitlines() if n]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001
            pass


def spawn(cell: str, args: argparse.Namespace) -> int:
    """A cell in a fresh interpreter (when forking is not safe here)."""
    with open(args.out / f"{cell}.stderr", "wb") as log:
        child = subprocess.Popen(
            [sys.executable, "-W", "ignore", "-m", "overlap_spec.harness.conformance.tier",
             *_cell_argv(cell, args)], stdout=log, stderr=log)
    return child.pid


def probe(cell: str, args: argparse.Namespace) -> bool:
    """Before any cell runs (``--wait``): a child builds ``cell``'s scheduler and reports
    the modules that imported, which the server imports too. Whether forking is still
    safe afterwards (no import started a thread)."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(reader)
        run_child(cell, args, writer, probe_only=True)
    os.close(writer)

    def stop(signum: int, frame: FrameType | None) -> None:
        os.kill(pid, signal.SIGKILL)
        os._exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    import_reported(reader)
    os.waitpid(pid, 0)
    signal.signal(signal.SIGTERM, previous)
    return threading.active_count() == 1


def serve(cells: list[str], args: argparse.Namespace, probed: bool = False,
          fork: bool = True) -> None:
    pending = list(cells)
    running: dict[int, tuple[str, float]] = {}
    fork = fork and not args.no_fork

    def stop(signum: int, frame: FrameType | None) -> None:
        for pid in running:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    while pending or running:
        while pending and len(running) < args.jobs:
            cell = pending.pop(0)
            emit(event="start", cell=cell)
            started = time.perf_counter()
            if not fork:
                running[spawn(cell, args)] = (cell, started)
                continue
            reader, writer = os.pipe() if not probed else (None, None)
            pid = os.fork()
            if pid == 0:
                if reader is not None:
                    os.close(reader)
                run_child(cell, args, writer)
            running[pid] = (cell, started)
            if reader is not None and writer is not None:
                os.close(writer)
                probed = True
                import_reported(reader)
                if threading.active_count() != 1:
                    fork = False  # an import started a thread: no fork is safe from now on
        pid, status = os.waitpid(-1, os.WNOHANG)
        now = time.perf_counter()
        if pid == 0:
            for late, (cell, started) in running.items():
                if now - started > args.timeout:
                    os.kill(late, signal.SIGKILL)
                    os.waitpid(late, 0)
                    del running[late]
                    emit(event="done", cell=cell, exit=-signal.SIGKILL,
                         wall_s=round(now - started, 1),
                         reason=f"timed out after {args.timeout}s")
                    break
            time.sleep(POLL_S)
            continue
        cell, started = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        emit(event="done", cell=cell, exit=code, wall_s=round(now - started, 1),
             reason=None if code == 0 else last_line(args.out / f"{cell}.stderr"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m overlap_spec.harness.conformance.server")
    parser.add_argument("--cells", required=True, help="comma-separated cell names")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--preset", default="minimal")
    parser.add_argument("--sizes", default="", help="NAME=N,... in place of the preset's")
    parser.add_argument("--sglang-src", type=Path, default=None)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--no-fork", action="store_true",
                        help="each cell in a fresh interpreter (no fork; slower)")
    parser.add_argument("--wait", action="store_true",
                        help="import (and probe a scheduler build) now, then run the cells "
                        "only once a line 'go' arrives on standard input")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from overlap_spec.upstream.bootstrap import (
        CannotDrive,
        UpstreamUnavailable,
        find_sglang_source,
        load_sglang,
    )

    try:
        source = load_sglang(args.sglang_src)
        # Before anything patches it: every name the tier relies on (upstream/compat.py).
        from overlap_spec.upstream.compat import get_mismatches

        mismatches = [m.to_json() for m in get_mismatches()]
        if not mismatches:
            preload()
    except CannotDrive as error:
        found = find_sglang_source(args.sglang_src)
        emit(event="cannot-drive", sglang=None if found is None else found.to_json(),
             mismatches=[{"hook": error.hook, "change": str(error.args[0])}])
        return 3
    except UpstreamUnavailable as error:
        emit(event="error", message=str(error.args[0] if error.args else error))
        return 2
    except Exception as error:  # noqa: BLE001 - a tree that does not import: one line
        found = find_sglang_source(args.sglang_src)
        emit(event="cannot-drive", sglang=None if found is None else found.to_json(),
             mismatches=[{"hook": "import sglang", "change": "sglang does not import: "
                          f"{type(error).__name__}: {str(error)[:300]}"}])
        return 3
    if mismatches:
        emit(event="cannot-drive", sglang=source.to_json(), mismatches=mismatches)
        return 3
    if threading.active_count() != 1:
        emit(event="error", message="importing sglang started threads "
             f"({', '.join(t.name for t in threading.enumerate())}); cannot fork cells safely")
        return 2
    emit(event="sglang", **source.to_json())
    args.out.mkdir(parents=True, exist_ok=True)
    cells = [c for c in args.cells.split(",") if c]
    if not cells:
        return 0
    args.shares = get_shares(cells, args)
    if not args.wait:
        serve(cells, args)
        return 0
    fork = not args.no_fork and probe(cells[0], args)
    if sys.stdin.readline().strip() != "go":
        return 0  # the driver went away (or stopped) before the upstream tier
    serve(cells, args, probed=True, fork=fork)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
