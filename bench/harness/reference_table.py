"""RHO-LOSS with its reference losses precomputed once per pool and seed (``rho_lookup`` in bench.harness.compare).

The reference ``rho`` pretrains at the start of each run is built here instead, from the same
method config, seed and target batches (:func:`~selection_callbacks.scoring.reference.pretrained_reference`),
its loss on every pool sequence is written to a table, and the run looks the losses up by
``sample_id`` (``reference_losses``): the same selections without the reference's forward on each
step. The pretraining and the pool pass are a one-off cost, shared by every run on the pool with
that seed; bench.harness.compare charges it to the run's wall-clock like an offline selector's seconds and
reports it apart (``one_off_seconds``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import yaml

from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.methods import RhoLossSelection
from selection_callbacks.nn.gpt import GPTConfig
from selection_callbacks.scoring.reference import pretrained_reference
from selection_callbacks.scoring.reference_losses import ReferenceLossTable


def rho_reference_table(pool: str, target: str, val: str, scale: Path, method_config: Path, seed: int, folder: Path,
                        threads: int | None = None, overrides: list[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """Write ``folder/reference_losses.npz`` for ``seed`` (the method config with a variant's ``overrides``, as
    the run's command line sets them); returns the run's further selection overrides."""
    init_args = yaml.safe_load(method_config.read_text())["selection"].get("init_args") or {}
    init_args.update({key: yaml.safe_load(value) for key, value in overrides})
    cfg = yaml.safe_load(scale.read_text())
    seq_len = int(cfg.get("data", {}).get("seq_len", 128))
    learner = GPTConfig(**{**cfg.get("model", {}).get("config", {}), "block_size": seq_len})
    selector = RhoLossSelection(**{**init_args, "seed": seed})
    config = selector.proxy_config(SimpleNamespace(datamodule=None), SimpleNamespace(config=learner))
    dm = PoolDataModule(pool, target, val, seq_len=seq_len, seed=seed, progress=False)
    dm.setup("fit")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        reference = pretrained_reference(dm, config, selector.reference_steps, selector.reference_batch_size,
                                         selector.reference_lr, seed)
        table = ReferenceLossTable.of_pool(reference, dm.splits["pool"], 64, torch.device("cpu"), progress=False)
    finally:
        torch.set_num_threads(previous)
    return [("reference_losses", str(table.write(folder / "reference_losses.npz")))]
