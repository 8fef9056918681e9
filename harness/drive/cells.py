"""What every command shares: the one cell selector, the one default seed, the usage error
and the parser's argument types.

The argument types check ranges and paths while the command line is parsed, so a bad
number or an output path that cannot be written is a one-line error (exit 2) before a
run starts, never a traceback at its end. This module stays light (no torch, Z3 or
Hypothesis): ``overlap-spec --help`` imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, NoReturn

from overlap_spec.harness.catalogue import BUGS
from overlap_spec.spec.config import (
    PRESETS,
    Cell,
    ModelConfig,
    Preset,
    enumerate_cells,
    enumerate_radix_cells,
    get_departures,
)

# The seed every tier runs under unless told otherwise; printed with every failure.
DEFAULT_SEED = 20261122

# The Hypothesis budgets' names (harness.drive.stateful.PROFILES holds the budgets and
# imports Hypothesis, which the parser must not; a test checks that the two agree).
PROFILE_NAMES: Final = ("quick", "ci", "dev", "thorough")

# The widest cell name, bare and as a configuration (``CELL@preset``): progress lines and
# tables pad to these, so a long name never pushes its row out of line.
CELL_WIDTH: Final = max(len(cell.name) for cell in (*enumerate_cells(),
                                                     *enumerate_radix_cells()))
CONFIG_WIDTH: Final = CELL_WIDTH + 1 + max(map(len, PRESETS))


class UsageError(ValueError):
    """Bad input to a command: ``overlap-spec`` prints this one line and exits 2."""


class NoCellMatches(UsageError):
    """A cell pattern list that names no cell: a usage error, never an empty run."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors raise :class:`UsageError` (one line, exit 2, printed by the
    command's ``main``) instead of printing the usage block and exiting."""

    def error(self, message: str) -> NoReturn:
        hint = "" if "(see '" in message else f" (see '{self.prog} --help')"
        raise UsageError(message + hint)


def report_usage_error(error: UsageError) -> int:
    """Print ``error`` as the one line ``overlap-spec: error: MESSAGE``; returns 2."""
    print(f"overlap-spec: error: {error}", file=sys.stderr)
    return 2


def select_cells(patterns: str | None, radix: bool = False,
                 with_radix: bool = False) -> list[Cell]:
    """The cells whose names match any of the comma-separated globs (all when None), among
    :func:`enumerate_cells`; with ``radix`` among the radix cells only
    (:func:`enumerate_radix_cells`: the upstream tier's ``--radix``); with ``with_radix``
    among both, the radix cells after the others (``check`` and ``review``, whose run holds
    both). Each glob must match a cell: a misspelt name among others is a usage error, not
    a cell silently left out."""
    if with_radix:
        cells = [*enumerate_cells(), *enumerate_radix_cells()]
    else:
        cells = list(enumerate_radix_cells() if radix else enumerate_cells())
    if not patterns:
        return cells
    hint = "'overlap-spec cells' and 'overlap-spec cells --radix'" if with_radix else \
        "'overlap-spec cells'"
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    if not wanted:
        raise NoCellMatches(f"no cell matches {patterns!r} (see {hint})")
    matches = {p: [c for c in cells if fnmatch.fnmatch(c.name, p)] for p in wanted}
    unmatched = [p for p, found in matches.items() if not found]
    if unmatched:
        raise NoCellMatches(f"no cell matches {', '.join(map(repr, unmatched))} "
                            f"(see {hint})")
    return [c for c in cells if any(c in found for found in matches.values())]


def get_release_twin(cell: Cell) -> Cell:
    """A radix cell's release cell (the same cell with the radix cache off); any other cell
    is its own."""
    return replace(cell, radix=False) if cell.radix else cell


def get_fault_sizes(sizes: dict[str, int] | None, faults: frozenset[str]
                    ) -> dict[str, int] | None:
    """``sizes`` with the sizes each switched-on bug's trigger needs (``Bug.sizes``: B18
    needs chunked prefill) where ``sizes`` leaves them at the preset's, so a fault is never
    run where it cannot trip; the configuration's name then shows them."""
    merged = dict(sizes or {})
    for bug in BUGS:
        if bug.id in faults:
            for name, value in bug.sizes:
                merged.setdefault(name, value)
    return merged or sizes


def select_configs(patterns: str | None, preset: str,
                   sizes: dict[str, int] | None = None,
                   variants: bool = False, with_radix: bool = False) -> list[ModelConfig]:
    """The selected cells under one preset, or under every preset for ``"all"``, with the
    preset's ``sizes`` overridden (:func:`make_preset`); no match, or a size a cell cannot
    take, is a :class:`UsageError` (exit 2, one line, before anything runs).

    ``with_radix`` (``check`` and ``review``): the radix cells are selected too, after the
    others (:func:`select_cells`). ``variants`` (their default run, without ``--sizes``):
    each cell at its preset's sizes, followed by the size variants that reach what those
    sizes do not (:func:`get_size_variants`), where the cell takes them; a radix cell at the
    sizes the release serves it with (:func:`get_upstream_config`: chunked prefill where
    the overlap scheduler is on), one more variant of its release twin in the budget
    (:func:`get_budget_shares`)."""
    names = list(PRESETS) if preset == "all" else [preset]
    cells = select_cells(patterns, with_radix=with_radix)
    configs = []
    for name in names:
        for cell in cells:
            if cell.radix and variants and not sizes:
                configs.append(get_upstream_config(cell, name, {}))
                continue
            configs.append(ModelConfig(cell, make_preset(name, sizes or {})))
            if variants and not sizes:
                configs.extend(ModelConfig(cell, make_preset(name, v.sizes))
                               for v in get_size_variants(name) if v.applies(cell))
    for config in configs:
        problem = check_sizes(config)
        if problem is not None:
            raise UsageError(problem)
    return configs


# --- the default run's size variants ----------------------------------------------------
# The chunk size the release's serving default comes to at each preset's sizes. Chunked
# prefill is on by default (``chunked_prefill_size`` None resolves to 2048..16384 tokens by
# memory, ``memory_hook.py``), below the context of the models it serves (32K..128K): long
# prompts are chunked, short ones not. Scaled to a preset: a chunk below its longest
# prompts and above its short ones, a page multiple for every cell.
SERVING_CHUNKED_PREFILL_SIZE: Final = {"minimal": 4, "realistic": 32}


def is_serving_default(cell: Cell) -> bool:
    """What sglang 0.5.23 serves by default (page size and speculation being the
    deployment's choice): the overlap scheduler on, no era or proposal switch."""
    return cell.overlap and not get_departures(cell)

@dataclass(frozen=True)
class SizeVariant:
    """Sizes in place of a preset's that reach mechanisms its own sizes never do."""

    name: str
    sizes: dict[str, int]
    reaches: str
    applies: Callable[[Cell], bool]


# The out-of-memory abort: a request alone does not fit its next decode. Only speculative
# cells get there (a non-spec decode asks one token, and admission caps a request below the
# pool). Pools small enough that a request admitted alone outgrows its decode reserve,
# large enough that a one-token prompt still decodes (1 + 2A fits: at the minimal preset
# 9 of 12 tokens for a chain and a page-1 tree, 33 of 48 for a page-4 tree). Measured: the
# abort in 22 of 26 spec cells (``tests/test_mechanisms.py`` counts it over the run).
_OOM_SIZES: Final = {"kv_tokens": 12, "paged_tree_kv_tokens": 48}


def _takes_sizes(preset: str, sizes: dict[str, int]) -> Callable[[Cell], bool]:
    def applies(cell: Cell) -> bool:
        return check_sizes(ModelConfig(cell, make_preset(preset, sizes))) is None
    return applies


def get_size_variants(preset: str) -> tuple[SizeVariant, ...]:
    """The variants the default run adds to ``preset``'s own sizes, each in the cells that
    take it: chunked prefill as the release serves it (on by default: a chunk below the
    long prompts, ``SERVING_CHUNKED_PREFILL_SIZE``), mixed chunks (and spec's mixed
    tails), and the out-of-memory abort (spec cells). The minimal preset only: the default
    run's; the realistic preset (``--preset realistic``) runs at its own sizes, where each
    variant would need a witness corpus whose seeded search takes minutes a cell."""
    if preset != "minimal":
        return ()
    chunk = SERVING_CHUNKED_PREFILL_SIZE[preset]
    chunked = {"chunked_prefill_size": chunk}
    mixed = {"chunked_prefill_size": chunk, "mixed_chunk": 1}
    return (
        SizeVariant("chunked", chunked, "chunked prefill as the release serves it",
                    _takes_sizes(preset, chunked)),
        SizeVariant("mixed", mixed, "mixed chunks; spec's mixed tails",
                    _takes_sizes(preset, mixed)),
        SizeVariant("oom", _OOM_SIZES, "the out-of-memory abort, small pools",
                    lambda cell: cell.is_spec),
    )


def get_budget_shares(configs: Sequence[ModelConfig]) -> list[float]:
    """Each configuration's share of its tier's per-cell budget. A release cell and its
    radix twin (:func:`get_release_twin`) hold one cell's budget together, so the radix
    cells add no sequences to a run: a cell run at its preset's sizes alone gets all of
    it; with size variants or its radix twin, the release cell at the preset's own sizes
    gets half and the others (the variants, the radix twin) split the other half (the
    default run searches as many sequences as a run at the preset's sizes did); without
    the preset's own sizes among them (``--sizes``), they split it equally."""
    def group(config: ModelConfig) -> tuple[str, str]:
        return get_release_twin(config.cell).name, split_preset(config.preset)[0]

    def is_lead(config: ModelConfig) -> bool:
        return not config.cell.radix and SIZES_MARK not in config.preset.name

    members: dict[tuple[str, str], list[ModelConfig]] = {}
    for config in configs:
        members.setdefault(group(config), []).append(config)
    shares = []
    for config in configs:
        together = members[group(config)]
        count = len(together)
        if count == 1:
            shares.append(1.0)
        elif not any(is_lead(c) for c in together):
            shares.append(1.0 / count)
        elif is_lead(config):
            shares.append(0.5)
        else:
            shares.append(0.5 / (count - 1))
    return shares


def describe_variants(configs: Sequence[ModelConfig]) -> str | None:
    """The line that says which size variants and radix cells a run added to the cells at
    their preset's sizes, and how they share the budget (None: nothing added)."""
    added: Counter[str] = Counter()
    labels: dict[str, str] = {}
    radix = [c for c in configs if c.cell.radix]
    for config in configs:
        if config.cell.radix:
            continue
        base, sizes = split_preset(config.preset)
        for variant in get_size_variants(base):
            if sizes and sizes == variant.sizes:
                added[variant.name] += 1
                labels[variant.name] = f"{variant.name} ({format_sizes(sizes)}: {variant.reaches})"
    twins = {(get_release_twin(c.cell), c.preset.name.split(SIZES_MARK, 1)[0])
             for c in configs if not c.cell.radix}
    paired = [c for c in radix
              if (get_release_twin(c.cell), c.preset.name.split(SIZES_MARK, 1)[0]) in twins]
    if not added and not paired:
        return None
    if not added:  # one size set (--sizes, --faults): a pair splits one cell's budget
        cells = len({c.cell for c in paired})
        return f"radix cells: {cells}, each sharing its release cell's budget (half each)"
    chunked = len({c.cell for c in paired if c.preset.chunked_prefill_size})
    parts = [f"{labels[name]} in {count} cell{'s' * (count != 1)}"
             for name, count in added.items()]
    if paired:
        cells = len({c.cell for c in paired})
        parts.append(f"radix (the release cell with its prefix cache on, at the sizes the "
                     f"release serves it: chunked prefill in the {chunked} with the overlap "
                     f"scheduler) in {cells} cell{'s' * (cells != 1)}")
    own = len(configs) - sum(added.values()) - len(radix)
    return (f"default run: {own} cell{'s' * (own != 1)} at the preset's sizes (half of each "
            f"cell's budget), and size variants sharing the other half: {'; '.join(parts)} "
            "('--sizes' runs one size set instead)")


def get_upstream_config(cell: Cell, preset: str, sizes: dict[str, int]) -> ModelConfig:
    """The configuration the upstream tier drives ``cell`` at: ``sizes`` in place of the
    preset's and, in a cell the release serves by default (:func:`is_serving_default`),
    its chunked prefill, which is on there (``SERVING_CHUNKED_PREFILL_SIZE``) unless
    ``sizes`` set ``chunked_prefill_size`` themselves (0: off)."""
    if is_serving_default(cell) and "chunked_prefill_size" not in sizes:
        sizes = {**sizes,
                 "chunked_prefill_size": SERVING_CHUNKED_PREFILL_SIZE[preset]}
    return ModelConfig(cell, make_preset(preset, sizes))


def get_upstream_shares(cells: Sequence[Cell], preset: str,
                        sizes: dict[str, int]) -> list[float]:
    """Each cell's share of the upstream tier's sequences a cell: a release cell and its
    radix twin, both in the run, split one cell's (:func:`get_budget_shares` of the
    configurations the tier drives them at)."""
    return get_budget_shares([get_upstream_config(cell, preset, sizes) for cell in cells])


def get_share_examples(examples: int, share: float) -> int:
    """A share of ``examples``, at least one."""
    return max(1, round(examples * share))


# --- sizes a script or a command line may set in place of its preset's ------------------
# Each with its allowed range. The pool is counted in tokens and must be whole pages; the
# lower ends are the least the scheduler is defined for (one page, one request row, one
# draft step), the upper ends keep a run's state small enough to check step by step.
SIZE_LIMITS: Final = {
    "kv_tokens": (1, 8192, "the token-to-KV pool size in tokens, whole pages"),
    "max_running_requests": (1, 32, "the request pool's rows"),
    "paged_tree_kv_tokens": (1, 8192, "the pool of a cell with a tree on pages > 1, in "
                                      "tokens, whole pages"),
    "chain_steps": (1, 7, "the v2 chain's draft steps (draft tokens = steps + 1)"),
    "tree_topk": (2, 4, "the v2 tree's branches per step"),
    "max_context_len": (4, 256, "the context length in tokens (the row is this plus its "
                                "headroom; a longer prompt is refused)"),
    "chunked_prefill_size": (0, 8192, "prefill chunk tokens, whole pages (0: no chunking)"),
    "mixed_chunk": (0, 1, "enable_mixed_chunk: decodes ride in the prefill chunk's batch "
                          "(needs chunked_prefill_size; not in era, proposal or mirrorless "
                          "spec cells)"),
}
SIZES_MARK: Final = "["  # a preset with sizes is named like "minimal[kv_tokens=16]"


def make_preset(base: str, sizes: dict[str, int]) -> Preset:
    """Preset ``base`` with ``sizes`` in place of its own, named after both (so a
    configuration's name says which sizes it ran with); a :class:`UsageError` names the
    field that is unknown or out of its range."""
    if base not in PRESETS:
        raise UsageError(f"unknown preset {base!r}; known: {', '.join(PRESETS)}")
    preset = PRESETS[base]
    changed: dict[str, Any] = {}
    for name, value in sizes.items():
        if name not in SIZE_LIMITS:
            raise UsageError(f"unknown size {name!r}; settable: {', '.join(SIZE_LIMITS)}")
        low, high, meaning = SIZE_LIMITS[name]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise UsageError(f"size {name!r} is {value!r}; allowed {low}..{high} ({meaning})")
        if value != getattr(preset, name):
            changed[name] = value
    if not changed:
        return preset
    label = format_sizes(changed)
    return dataclasses.replace(preset, name=f"{base}{SIZES_MARK}{label}]", **changed)


def split_preset(preset: Preset) -> tuple[str, dict[str, int]]:
    """(base preset name, the sizes that differ from it): :func:`make_preset` undone."""
    base = preset.name.split(SIZES_MARK, 1)[0]
    original = PRESETS[base]
    return base, {name: getattr(preset, name) for name in SIZE_LIMITS
                  if getattr(preset, name) != getattr(original, name)}


def check_sizes(config: ModelConfig) -> str | None:
    """Why ``config``'s sizes do not fit its cell, or None."""
    page = config.page_size
    size = "paged_tree_kv_tokens" if config.is_paged_tree else "kv_tokens"
    if config.kv_tokens % page:
        return (f"size '{size}' is {config.kv_tokens}; cell {config.cell.name} "
                f"needs whole pages of {page} tokens")
    if config.preset.chunked_prefill_size % page:
        return (f"size 'chunked_prefill_size' is {config.preset.chunked_prefill_size}; cell "
                f"{config.cell.name} needs whole pages of {page} tokens (the release's "
                "validation_hook asserts it)")
    if config.preset.mixed_chunk and not config.preset.chunked_prefill_size:
        return ("size 'mixed_chunk' is 1 without 'chunked_prefill_size': the release mixes "
                "decodes into a prefill only when it chunks (is_mixed_chunk)")
    cell = config.cell
    if config.preset.mixed_chunk and cell.is_spec and not cell.mixes_spec_tails:
        return (f"size 'mixed_chunk' is 1 in spec cell {cell.name}: spec's mixed tails are "
                "modelled in the release's spec cells with the CPU mirror only (an era or "
                "proposal switch, or a cell without the mirror, where the release's tail "
                "rebinding copies the relay to the host all the same, is not); choose those "
                "or non-spec cells")
    return None


def format_sizes(sizes: dict[str, int]) -> str:
    """``NAME=N,...``: what :func:`parse_sizes` reads back."""
    return ",".join(f"{name}={value}" for name, value in sorted(sizes.items()))


def parse_sizes(text: str) -> dict[str, int]:
    """An argparse ``type``: ``NAME=N,...`` with every name settable and every N in its
    range (:data:`SIZE_LIMITS`)."""
    sizes: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        name, equals, value = part.partition("=")
        if not equals or not value.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"expected NAME=N[,NAME=N...], got {part!r}")
        sizes[name.strip()] = int(value)
    try:
        make_preset(next(iter(PRESETS)), sizes)
    except UsageError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return sizes


# --- argument types: argparse calls them on the text; an ArgumentTypeError is the message
def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``low..high`` (no upper end when ``high`` is None)."""
    allowed = f">= {low}" if high is None else f"{low}..{high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range (allowed: {allowed})")
        return value

    return parse


positive_int: Final = int_in(1)
nonnegative_int: Final = int_in(0)


def int_list_in(low: int, high: int) -> Callable[[str], tuple[int, ...]]:
    """An argparse ``type``: comma-separated integers, each in ``low..high``, at least one."""
    one = int_in(low, high)

    def parse(text: str) -> tuple[int, ...]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        return tuple(one(p) for p in parts)

    return parse


def name_list(known: Sequence[str], what: str) -> Callable[[str], str]:
    """An argparse ``type``: comma-separated names, each one of ``known``, at least one (the
    text comes back unchanged: the commands split it)."""

    def parse(text: str) -> str:
        names = [p.strip() for p in text.split(",") if p.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            found = f"unknown {what} {', '.join(unknown)}" if unknown else f"no {what} given"
            raise argparse.ArgumentTypeError(f"{found}; known: {', '.join(known)}")
        return text

    return parse


def cell_patterns(text: str) -> str:
    """An argparse ``type``: comma-separated cell names or globs that match some cell."""
    try:
        select_cells(text)
    except NoCellMatches as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def check_cell_patterns(text: str) -> str:
    """An argparse ``type``: :func:`cell_patterns` among every cell and the radix cells
    (``check`` and ``review``, whose run holds both)."""
    try:
        select_cells(text, with_radix=True)
    except NoCellMatches as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def any_cell_patterns(text: str) -> str:
    """:func:`cell_patterns` among the radix cells too (the upstream tier's ``--cells``:
    which list applies is its ``--radix``, checked when the command starts)."""
    try:
        select_cells(text)
    except NoCellMatches:
        try:
            select_cells(text, radix=True)
        except NoCellMatches as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return text


def input_file(text: str) -> str:
    """An argparse ``type``: a readable file (not a directory)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file {text}")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"cannot read {text} (permission denied)")
    return text


def input_dir(text: str) -> str:
    """An argparse ``type``: an existing directory."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a directory" if path.exists()
                                         else f"no such directory {text}")
    return text


def _probe_write(directory: Path) -> str | None:
    """Create and remove a file in ``directory``: None when that works, else why not.
    ``os.access`` is not enough: root passes it on a read-only mount (``/sys``) or a
    ``/proc`` directory where no file can be created."""
    try:
        handle, name = tempfile.mkstemp(prefix=".overlap-spec-probe-", dir=directory)
    except OSError as error:
        return error.strerror or str(error)
    os.close(handle)
    try:
        os.unlink(name)
    except OSError:
        pass
    return None


def output_file(text: str) -> str:
    """An argparse ``type``: a file path the run will be able to write (checked now, by
    creating a file beside it, so a long run does not end in an error that loses its
    verdict)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file path")
    parent = path.parent
    if not parent.exists():
        raise argparse.ArgumentTypeError(f"directory {parent} does not exist")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{parent} is not a directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text} (permission denied)")
    problem = _probe_write(parent)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"cannot write {text} ({problem.lower()})")
    return text


def output_dir(text: str) -> str:
    """An argparse ``type``: a directory the run can write into, or create with its parents
    (checked now by creating a file in it, or in the nearest folder that exists; it is
    created when the run writes)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a directory")
    existing = path.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create {text}: {existing} is a file")
    problem = _probe_write(existing)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"cannot write in {existing} ({problem.lower()})")
    return text


DEVICE_KINDS: Final = ("auto", "cpu", "cuda")


def device_name(text: str) -> str:
    """An argparse ``type``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``, a CUDA device only
    when torch sees it (torch is imported only when CUDA is asked for)."""
    kind, colon, index = text.partition(":")
    if kind not in DEVICE_KINDS or (colon and (kind != "cuda" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"unknown device {text!r} (expected auto, cpu, cuda "
                                         "or cuda:N)")
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text} asked for, but torch sees no CUDA device")
        if colon and int(index) >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: torch sees "
                                             f"{torch.cuda.device_count()} CUDA device(s)")
    return text
