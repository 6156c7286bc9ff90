"""The ``train.py fit`` child every benchmark starts: its command line and its environment's thread count."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root (``train.py``, ``configs/``)."""


def thread_env(threads: int) -> dict[str, str]:
    """This process's environment with ``threads`` CPU threads for a child's BLAS and OpenMP pools."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def fit_command(configs: Sequence[str | Path], seed: int, pool: str | Path, target: str | Path, val: str | Path,
                steps: int, eval_every: int, run_dir: str | Path) -> list[str]:
    """The ``train.py fit`` command every benchmark run starts from: its configs (repository-relative or
    absolute), the paired seed (``seed_everything`` and the candidate stream), the three splits, the run length
    and validation interval, and the run folder. Callers append their own flags."""
    cmd = [sys.executable, str(ROOT / "train.py"), "fit"]
    for config in configs:
        cmd += ["--config", str(ROOT / config)]
    cmd += ["--seed_everything", str(seed), "--data.seed", str(seed)]
    cmd += ["--data.pool", str(pool), "--data.target", str(target), "--data.val", str(val), "--data.progress", "false"]
    cmd += ["--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(eval_every)]
    return cmd + ["--trainer.default_root_dir", str(run_dir), "--trainer.enable_progress_bar", "false"]
