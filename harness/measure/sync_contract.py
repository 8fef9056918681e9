"""The sync contract: host-blocking syncs, D2H copies and device launches per iteration.

One steady-state decode iteration of gpu_impl is measured per configuration cell: a
full batch of long requests, past warm-up, accept length 1, no admissions. The
expected host-sync counts are the spec's (``spec.transitions.compute_host_sync_budget``,
digest section 6); no overlap cell may block the host on the schedule stream
(``stream:schedule``), which would chain the WAR fence to the whole forward.

``era="A"`` runs gpu_impl's era-A baseline (digest 3.4: ``verify_done`` host sync and a
blocking ``.cpu()`` of seq_lens on the schedule stream), for the benchmark only.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from overlap_spec.gpu_impl.race import RaceDetector, count_as_launch
from overlap_spec.gpu_impl.scheduler import Scheduler as GpuScheduler
from overlap_spec.gpu_impl.streams import Streams
from overlap_spec.spec.config import Cell, ModelConfig, Preset, SpecMode, enumerate_cells
from overlap_spec.spec.happens_before import SCHEDULE
from overlap_spec.spec.state import IterationChoices
from overlap_spec.spec.transitions import compute_host_sync_budget
from overlap_spec.spec.units import TokenCount


def make_steady_preset(batch_size: int) -> Preset:
    """Room for ``batch_size`` long requests to decode for many iterations."""
    context = 192
    return Preset(
        name=f"steady-bs{batch_size}", max_running_requests=batch_size,
        kv_tokens=batch_size * (context + 64), max_context_len=TokenCount(context),
        max_prompt_len=TokenCount(8), max_new_tokens=TokenCount(160),
        chain_steps=3, tree_topk=2, tree_steps=2, tree_draft_tokens=4)


class _LaunchCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts device operations per stream on CUDA (same rule as the race detector)."""

    def __init__(self, streams: Streams) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.streams = streams
        self.launches: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if count_as_launch(func):
            stream = self.streams.current()
            self.launches[stream] = self.launches.get(stream, 0) + 1
        return func(*args, **(kwargs or {}))


@dataclass
class IterationCounts:
    cell: str
    batch_size: int
    host_syncs: tuple[str, ...]
    d2h_copies: tuple[str, ...]
    launches: dict[str, int]
    host_seconds: list[float] = field(default_factory=list)  # per measured iteration

    @property
    def schedule_stream_syncs(self) -> int:
        return sum(1 for s in self.host_syncs if s == f"stream:{SCHEDULE}")

    @property
    def total_launches(self) -> int:
        return sum(self.launches.values())


def measure_steady_state(cell: Cell, batch_size: int = 4, device: torch.device | None = None,
                         warmup: int = 3, iterations: int = 1, era: str = "B",
                         count_launches: bool = True) -> IterationCounts:
    """Counters of the last ``iterations`` steady-state iterations (averaged by the caller).

    Syncs and D2H copies are those of one iteration (the last); launches likewise.
    """
    config = ModelConfig(cell, make_steady_preset(batch_size))
    device = device or torch.device("cpu")
    detector = RaceDetector() if count_launches and device.type == "cpu" else None
    streams = Streams(device, detector)
    counter = _LaunchCounter(streams) if count_launches and detector is None else None
    mode: TorchDispatchMode | None = detector or counter
    with mode if mode is not None else nullcontext():
        scheduler = GpuScheduler(config, frozenset(), None, streams=streams, era=era)
        for _ in range(batch_size):
            scheduler.admit(4, config.preset.max_new_tokens)
        steps = config.preset.chain_steps if cell.spec_mode is SpecMode.V2_CHAIN else 0
        choices = IterationChoices(allow_prefill=True, accept_lens=(1,), spec_steps=steps)
        scheduler.run_iteration(choices)  # the prefill of the whole batch
        decode = IterationChoices(allow_prefill=False, accept_lens=(1,), spec_steps=steps)
        for _ in range(warmup):
            scheduler.run_iteration(decode)
        seconds: list[float] = []
        for _ in range(iterations):
            streams.counters.reset()
            if detector is not None:
                detector.launches.clear()
                detector.hidden_host_reads.clear()
            if counter is not None:
                counter.launches.clear()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            scheduler.run_iteration(decode)
            seconds.append(time.perf_counter() - started)
    launches = dict(detector.launches if detector is not None
                    else counter.launches if counter is not None else {})
    # A device read outside Streams (int(), .item()) is a host sync too; the race detector
    # sees it on CPU, where it is counted as "hidden:<where>".
    hidden = tuple(f"hidden:{where}" for where in
                   (detector.hidden_host_reads if detector is not None else ()))
    return IterationCounts(cell.name, batch_size, tuple(streams.counters.host_syncs) + hidden,
                           tuple(streams.counters.d2h_copies), launches, seconds)


def get_sync_table(device: torch.device | None = None,
                   batch_size: int = 4) -> list[IterationCounts]:
    """One steady-state iteration per configuration cell."""
    return [measure_steady_state(cell, batch_size, device) for cell in enumerate_cells()]


def render_sync_table(rows: list[IterationCounts]) -> str:
    lines = [f"{'cell':<28} {'syncs':>5} {'budget':>6} {'D2H':>4} {'launches':>8}  host syncs"]
    cells = {c.name: c for c in enumerate_cells()}
    for row in rows:
        budget = compute_host_sync_budget(cells[row.cell]) if row.cell in cells else "-"
        lines.append(f"{row.cell:<28} {len(row.host_syncs):>5} {budget!s:>6} "
                     f"{len(row.d2h_copies):>4} {row.total_launches:>8}  "
                     f"{', '.join(row.host_syncs)}")
    return "\n".join(lines)
