"""``overlap-spec bench gpu`` as a script: writes its results under bench/results/.

    PYTHONPATH=. python bench/bench_gpu.py [--device cuda] [--iterations 20]

The measurement itself is ``harness/measure/bench_gpu.py`` (era A vs today's design, batch sizes
1-1024); the result files carry the device name and the command.
"""

from __future__ import annotations

import sys
from pathlib import Path

from overlap_spec.harness.cli import main

if __name__ == "__main__":
    results = Path(__file__).resolve().parent / "results"
    sys.exit(main(["bench", "gpu", "--out", str(results), *sys.argv[1:]]))
