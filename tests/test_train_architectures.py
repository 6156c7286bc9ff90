"""``python train.py`` with a learner of each of the nine Hugging Face families (``--model models.LitCausalLM
--model.config configs/model/tiny-*.yaml``): OPUS and RHO-LOSS on 16-token windows, two steps each, as two
subprocesses side by side, checked on the files they write (metrics.json and the selection ledger)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from selection_callbacks.data.datamodule import PoolDataModule

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt-neox", "olmo2", "phi3", "gemma2"]
STEPS, K, N = 2, 4, 8
METHODS = {
    "opus": ["--config", str(ROOT / "configs/method/opus.yaml"), "--selection.init_args.target_batch_size", "4"],
    "rho_windows": ["--config", str(ROOT / "configs/method/rho.yaml"), "--selection.init_args.score_len", "16",
                    "--selection.init_args.reference_steps", "2", "--selection.init_args.reference_batch_size", "4"],
}


@pytest.fixture(scope="module")
def cache(tiny_corpus, tmp_path_factory) -> Path:
    """The corpus tokenized once, before the concurrent runs read it."""
    path = tmp_path_factory.getbasetemp() / "cache"
    PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=32, cache_dir=str(path),
                   progress=False).prepare_data()
    return path


def _launch(name: str, method: str, corpus: dict[str, str], cache: Path, root: Path) -> subprocess.Popen:
    args = ["fit", "--config", str(ROOT / "configs/scale/cpu-tiny.yaml"), *METHODS[method],
            "--model", "models.LitCausalLM", "--model.config", str(ROOT / f"configs/model/tiny-{name}.yaml"),
            "--model.warmup_steps", "1", "--data.pool", corpus["pool"], "--data.target", corpus["target"],
            "--data.val", corpus["val"], "--data.seq_len", "32", "--data.batch_size", str(K), "--data.val_samples", "8",
            "--data.cache_dir", str(cache), "--data.progress", "false", "--trainer.max_steps", str(STEPS),
            "--trainer.val_check_interval", str(STEPS), "--trainer.enable_progress_bar", "false",
            "--trainer.logger", "false", "--trainer.default_root_dir", str(root)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env,
                            stdout=(root / "log.txt").open("w"), stderr=subprocess.STDOUT)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_opus_and_windowed_rho_loss_train_through_train_py(tiny_corpus, cache: Path, tmp_path: Path, name: str) -> None:
    roots = {method: tmp_path / method for method in METHODS}
    for root in roots.values():
        root.mkdir()
    procs = {method: _launch(name, method, tiny_corpus, cache, root) for method, root in roots.items()}
    for method, proc in procs.items():
        log = roots[method] / "log.txt"
        assert proc.wait(timeout=600) == 0, f"{name} {method}: train.py failed:\n{log.read_text()[-4000:]}"
    for method, root in roots.items():
        metrics = json.loads((root / "metrics.json").read_text())
        assert metrics["global_step"] == STEPS and 0 < metrics["val_bpb"] < 20, (name, method)
        assert metrics["selection"]["kept"] == STEPS * K and metrics["selection"]["candidates_seen"] == STEPS * N
        ledger = pq.read_table(sorted((root / "ledger").glob("rank0-*.parquet"))).to_pydict()
        assert sorted(set(ledger["step"])) == list(range(STEPS)) and len(ledger["step"]) == STEPS * N
        assert sum(ledger["selected"]) == STEPS * K
