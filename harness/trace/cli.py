"""``overlap-spec trace``: record a script's trace (reference or gpu_impl), check a trace
file, draw one: its timeline as Mermaid and SVG (``render``), the lengths behind an
arithmetic violation and the bound it broke (``plot``).

The parser needs none of the trace machinery (imported when a command runs); the render
window's default is restated here (``harness.trace.render.DEFAULT_WINDOW``, checked by
``tests/test_cli_errors.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from overlap_spec.harness.drive.cells import (
    ArgumentParser,
    UsageError,
    input_file,
    nonnegative_int,
    output_dir,
    output_file,
    report_usage_error,
)

if TYPE_CHECKING:
    from overlap_spec.harness.trace.format import ParsedTrace

DEFAULT_WINDOW = 80  # harness.trace.render.DEFAULT_WINDOW


# ----------------------------------------------------------------------------- CLI
def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``trace`` subcommand group: check, render, plot, record, strip."""
    sub = parser.add_subparsers(dest="trace_command", required=True)
    check = sub.add_parser("check", help="replay a trace through the spec; first violation")
    check.add_argument("file", type=input_file)
    check.add_argument("--json", type=output_file, metavar="PATH",
                       help="write the verdict as JSON")
    check.add_argument("--context", type=nonnegative_int, default=8,
                       help="preceding events to show")
    render = sub.add_parser(
        "render", help="draw the timeline as Mermaid and SVG (and the length plot of an "
        "arithmetic violation)",
        description="Write STEM.mmd (a Mermaid sequence diagram) and STEM.svg (a timeline, "
        "one lane per stream) of a trace; the racing pair is red and linked, named by its "
        "ID and buffer. For an arithmetic (KV, SL, RP) violation also STEM.lengths.svg, "
        "as 'trace plot' draws it.")
    render.add_argument("file", type=input_file)
    render.add_argument("--out", type=output_dir, metavar="DIR", default=None,
                        help="where to write the pictures (default: beside FILE)")
    render.add_argument("--window", type=nonnegative_int, default=DEFAULT_WINDOW,
                        help="events drawn, centred on the racing access or the violation; "
                        "the race partner and the violation are always drawn, and each run "
                        f"of events left out is one row saying so (0: all; default "
                        f"{DEFAULT_WINDOW})")
    plot = sub.add_parser(
        "plot", help="plot the lengths behind an arithmetic violation (KV, SL, RP) as SVG",
        description="For a KV, SL or RP violation: each request it involves, its seq_lens, "
        "kv_committed_len, kv_allocated_len and ghost kv_len_true (RP: output_len and the "
        "ghost output_len_true) at every observation point as step lines, the violating "
        "point marked with the invariant ID and values, and the bound the invariant "
        "compares against: KV3's reserve kv_len_true + W at each spec decode launch, KV1's "
        "row width, KV8's settled length + lead, SL7's expected seq_lens, RP2's "
        "max_new_tokens; for KV4 and KV7 the page and pool-row map, the page or row in two "
        "places red. A line in the picture says what it draws as the bound, or that it "
        "draws none for that ID. A trace without such a violation (passing, inconclusive, "
        "a race) exits 2.")
    plot.add_argument("file", type=input_file)
    plot.add_argument("-o", "--output", type=output_file, default=None,
                      help="the SVG to write (default: FILE's stem + .lengths.svg beside it)")
    record = sub.add_parser("record", help="run an operation script and write its trace")
    record.add_argument("script", type=input_file)
    record.add_argument("-o", "--output", type=output_file, required=True)
    record.add_argument("--no-snapshots", action="store_true", help="omit state snapshots")
    strip = sub.add_parser("strip", help="drop the state snapshots from a trace")
    strip.add_argument("file", type=input_file)
    strip.add_argument("-o", "--output", type=output_file, required=True)
    parser.set_defaults(func=cmd_trace)


def read_trace_or_usage_error(path: Path) -> ParsedTrace:
    """The parsed trace; malformed or unreadable input is a :class:`UsageError` (exit 2)
    naming the file, and the line and field where the format says which."""
    from overlap_spec.harness.trace.format import TraceFormatError, read_trace

    try:
        return read_trace(path)
    except TraceFormatError as error:
        raise UsageError(f"{path}: {error}") from None
    except (OSError, ValueError, RecursionError) as error:
        # Permissions, and JSON the parser refuses: nested too deep, numbers too long.
        raise UsageError(f"{path}: trace: cannot read: {error}") from None


def cmd_trace(args: argparse.Namespace) -> int:
    """Exit codes: 0 pass, 1 violation or inconclusive; malformed input raises a
    :class:`UsageError` (exit 2)."""
    from overlap_spec.harness.drive.script import ScriptError, load_script
    from overlap_spec.harness.trace.check import check_trace, record_script_trace
    from overlap_spec.harness.trace.format import strip_snapshots

    if args.trace_command == "check":
        verdict = check_trace(read_trace_or_usage_error(Path(args.file)), args.context)
        print(verdict.describe())
        if args.json:
            Path(args.json).write_text(json.dumps(verdict.to_json(), indent=1) + "\n")
        return 0 if verdict.ok else 1
    if args.trace_command == "render":
        from overlap_spec.harness.trace.render import render_trace_file

        read_trace_or_usage_error(Path(args.file))  # malformed: exit 2 before writing
        written = render_trace_file(Path(args.file),
                                    Path(args.out) if args.out else None, args.window)
        for path in written:
            print(f"wrote {path}")
        return 0
    if args.trace_command == "plot":
        from overlap_spec.harness.trace.plot import PlotError, plot_trace_file

        read_trace_or_usage_error(Path(args.file))
        try:
            target = plot_trace_file(Path(args.file),
                                     Path(args.output) if args.output else None)
        except PlotError as error:
            raise UsageError(f"{args.file}: cannot plot: {error}") from None
        print(f"wrote {target}")
        return 0
    if args.trace_command == "record":
        from overlap_spec.upstream.bootstrap import UpstreamUnavailable

        try:
            script = load_script(Path(args.script))
            verdict = record_script_trace(script, Path(args.output), not args.no_snapshots)
        except (ScriptError, UpstreamUnavailable) as error:
            # Unreadable, or a script whose implementation cannot run here (sglang's,
            # outside its environment): said before anything is recorded.
            raise UsageError(str(error.args[0] if error.args else error)) from None
        print(f"wrote {args.output}")
        print(verdict.describe())
        return 0 if verdict.ok else 1
    read_trace_or_usage_error(Path(args.file))
    Path(args.output).write_text(strip_snapshots(Path(args.file).read_text()))
    print(f"wrote {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m overlap_spec.harness.trace.cli ...``: the same as ``overlap-spec trace ...``."""
    parser = ArgumentParser(prog="overlap-spec trace")
    add_trace_arguments(parser)
    try:
        args = parser.parse_args(argv)
        code: int = args.func(args)
    except UsageError as error:
        return report_usage_error(error)
    return code


if __name__ == "__main__":
    sys.exit(main())
