"""``overlap-spec bench gpu``: schedule-side host time and syncs per iteration.

For each batch size, one steady-state decode iteration of gpu_impl (see
:mod:`harness.sync_contract`) is timed on the host, repeated, in two designs:

- era B, today's design: ``resolve_seq_lens_cpu`` gated on ``publish_ready`` on the
  private D2H stream, the schedule stream never blocks;
- era A, the baseline (digest 3.4): a host ``verify_done`` synchronize and a blocking
  ``seq_lens.cpu()`` on the schedule stream before the next batch is prepared.

On CPU the "device" work runs synchronously, so the host time is Python and torch
dispatch overhead only; the sync counts are exact either way. On CUDA the host time
includes the blocking waits, which is what era A costs. Timings are reported, never
asserted (GUIDE: counts may be asserted, timings not).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from overlap_spec.harness.measure import BENCH_BATCH_SIZES
from overlap_spec.harness.measure.sync_contract import measure_steady_state
from overlap_spec.spec.config import get_cell

BENCH_CELL = "ov-p1-v2chain-cpu-honest"  # v2 chain, overlap, the CPU mirror: where eras differ


@dataclass
class BenchRow:
    device: str
    cell: str
    era: str
    batch_size: int
    host_ms_median: float
    host_ms_min: float
    host_syncs_per_iter: int
    schedule_stream_syncs_per_iter: int
    d2h_per_iter: int
    host_syncs: tuple[str, ...]


def get_device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return f"cpu ({platform.processor() or platform.machine()})"


def run_bench_gpu(device: torch.device, batch_sizes: tuple[int, ...] = BENCH_BATCH_SIZES,
                  iterations: int = 20, cell_name: str = BENCH_CELL) -> list[BenchRow]:
    cell = get_cell(cell_name)
    rows: list[BenchRow] = []
    for batch_size in batch_sizes:
        for era in ("A", "B"):
            counts = measure_steady_state(cell, batch_size, device, warmup=3,
                                          iterations=iterations, era=era,
                                          count_launches=False)
            millis = [s * 1e3 for s in counts.host_seconds]
            rows.append(BenchRow(
                get_device_name(device), cell.name, era, batch_size,
                round(statistics.median(millis), 4), round(min(millis), 4),
                len(counts.host_syncs), counts.schedule_stream_syncs, len(counts.d2h_copies),
                counts.host_syncs))
    return rows


def render_bench(rows: list[BenchRow]) -> str:
    lines = ["| batch | era | host ms/iter (median) | min | host syncs/iter | on S | D2H/iter |",
             "|---:|:---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row.batch_size} | {row.era} | {row.host_ms_median:.3f} | "
                     f"{row.host_ms_min:.3f} | {row.host_syncs_per_iter} | "
                     f"{row.schedule_stream_syncs_per_iter} | {row.d2h_per_iter} |")
    return "\n".join(lines)


def write_bench(rows: list[BenchRow], out_dir: Path, command: str) -> Path:
    """bench/results/gpu-<device>-<date>.{json,md}, with the device name and the command."""
    out_dir.mkdir(parents=True, exist_ok=True)
    device = rows[0].device if rows else "none"
    slug = "".join(ch if ch.isalnum() else "-" for ch in device.lower()).strip("-")
    stamp = time.strftime("%Y%m%d")
    base = out_dir / f"gpu-{slug}-{stamp}"
    document: dict[str, Any] = {
        "device": device, "command": command, "torch": torch.__version__,
        "host_threads": torch.get_num_threads(),
        "rows": [asdict(r) for r in rows],
    }
    base.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    base.with_suffix(".md").write_text(
        f"# bench gpu on {device}\n\ncommand: `{command}`, torch {torch.__version__}, "
        f"{torch.get_num_threads()} host thread(s)\n\n"
        + render_bench(rows) + "\n"
        + ("\nOn CPU the device work runs synchronously inside each call, so era A's blocking "
           "syncs cost nothing here: the host times are dispatch overhead; the sync counts "
           "are exact.\n" if device.startswith("cpu") else ""))
    return base.with_suffix(".md")
