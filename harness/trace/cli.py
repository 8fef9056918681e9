"""``overlap-spec trace``: record a script's trace (reference or gpu_impl), check a trace
file, draw one: its timeline as Mermaid and SVG (``render``), the lengths behind an
arithmetic violation (``plot``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from overlap_spec.harness.drive.script import (
    ScriptError,
    load_script,
)
from overlap_spec.harness.trace.check import check_trace_file, record_script_trace
from overlap_spec.harness.trace.format import (
    TraceFormatError,
    parse_trace,
    strip_snapshots,
)
from overlap_spec.harness.trace.plot import PlotError, plot_trace_file
from overlap_spec.harness.trace.render import DEFAULT_WINDOW, render_trace_file


# ----------------------------------------------------------------------------- CLI
def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``trace`` subcommand group: check, render, plot, record, strip."""
    sub = parser.add_subparsers(dest="trace_command", required=True)
    check = sub.add_parser("check", help="replay a trace through the spec; first violation")
    check.add_argument("file")
    check.add_argument("--json", metavar="PATH", help="write the verdict as JSON")
    check.add_argument("--context", type=int, default=8, help="preceding events to show")
    render = sub.add_parser(
        "render", help="draw the timeline as Mermaid and SVG (and the length plot of an "
        "arithmetic violation)",
        description="Write STEM.mmd (a Mermaid sequence diagram) and STEM.svg (a timeline, "
        "one lane per stream) of a trace; the racing pair is red and linked, named by its "
        "ID and buffer. For an arithmetic (KV, SL, RP) violation also STEM.lengths.svg, "
        "as 'trace plot' draws it.")
    render.add_argument("file")
    render.add_argument("--out", metavar="DIR", default=None,
                        help="where to write the pictures (default: beside FILE)")
    render.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                        help="events drawn, centred on the racing access or the violation; "
                        "the race partner and the violation are always drawn, and each run "
                        f"of events left out is one row saying so (0: all; default "
                        f"{DEFAULT_WINDOW})")
    plot = sub.add_parser(
        "plot", help="plot the lengths behind an arithmetic violation (KV, SL, RP) as SVG",
        description="For a KV, SL or RP violation: each request it involves, its seq_lens, "
        "kv_committed_len, kv_allocated_len and ghost kv_len_true (RP: output_len and the "
        "ghost output_len_true) at every observation point as step lines, the violating "
        "point marked with the invariant ID and values. A trace without such a violation "
        "(passing, inconclusive, a race) exits 2.")
    plot.add_argument("file")
    plot.add_argument("-o", "--output", default=None,
                      help="the SVG to write (default: FILE's stem + .lengths.svg beside it)")
    record = sub.add_parser("record", help="run an operation script and write its trace")
    record.add_argument("script")
    record.add_argument("-o", "--output", required=True)
    record.add_argument("--no-snapshots", action="store_true", help="omit state snapshots")
    strip = sub.add_parser("strip", help="drop the state snapshots from a trace")
    strip.add_argument("file")
    strip.add_argument("-o", "--output", required=True)
    parser.set_defaults(func=cmd_trace)


def cmd_trace(args: argparse.Namespace) -> int:
    """Exit codes: 0 pass, 1 violation or inconclusive, 2 malformed input or usage."""
    try:
        if args.trace_command == "check":
            verdict = check_trace_file(Path(args.file), args.context)
            print(verdict.describe())
            if args.json:
                Path(args.json).write_text(json.dumps(verdict.to_json(), indent=1) + "\n")
            return 0 if verdict.ok else 1
        if args.trace_command == "render":
            written = render_trace_file(Path(args.file),
                                        Path(args.out) if args.out else None, args.window)
            for path in written:
                print(f"wrote {path}")
            return 0
        if args.trace_command == "plot":
            try:
                target = plot_trace_file(Path(args.file),
                                         Path(args.output) if args.output else None)
            except PlotError as error:
                print(f"overlap-spec: {args.file}: cannot plot: {error}", file=sys.stderr)
                return 2
            print(f"wrote {target}")
            return 0
        if args.trace_command == "record":
            script = load_script(Path(args.script))
            verdict = record_script_trace(script, Path(args.output), not args.no_snapshots)
            print(f"wrote {args.output}")
            print(verdict.describe())
            return 0 if verdict.ok else 1
        text = Path(args.file).read_text()
        parse_trace(text)
        Path(args.output).write_text(strip_snapshots(text))
        print(f"wrote {args.output}")
        return 0
    except TraceFormatError as error:
        print(f"overlap-spec: {args.file if 'file' in args else args.script}: {error}",
              file=sys.stderr)
        return 2
    except ScriptError as error:
        print(f"overlap-spec: {error}", file=sys.stderr)
        return 2
    except FileNotFoundError as error:
        print(f"overlap-spec: no such file {error.filename}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """``python -m overlap_spec.harness.trace.cli ...``: the same as ``overlap-spec trace ...``."""
    parser = argparse.ArgumentParser(prog="overlap-spec trace")
    add_trace_arguments(parser)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
