"""docs/own-trainer.md runs as written; a run resumed through its loader keeps the uninterrupted run's ledger, and
one resumed through an ordinary DataLoader is warned about and replays the epoch's first superbatches."""

from __future__ import annotations

import os
import re
from pathlib import Path

import lightning as L
import pytest
import torch

from selection_callbacks.core.ledger_store import read_ledger

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "own-trainer.md"
CHECKPOINT = "checkpoints/epoch=0-step=5.ckpt"


def guide_blocks() -> list[str]:
    """The page's ```python blocks, in order."""
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)


@pytest.fixture(scope="module")
def guide(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The page's blocks executed in order in one namespace, in a fresh folder (its runs write under runs/)."""
    folder, namespace, here = tmp_path_factory.mktemp("guide"), {}, os.getcwd()
    os.chdir(folder)
    try:
        torch.manual_seed(0)  # the learner's initial weights, which the uninterrupted run below repeats
        for block in guide_blocks():
            exec(block, namespace)
    finally:
        os.chdir(here)
    return folder, namespace


def _rows(run: Path) -> list[tuple]:
    """(step, micro-batch, sample_id, score, selected) of every candidate in the run's ledger, in order."""
    table = read_ledger(run).sort_by([("step", "ascending"), ("micro_batch", "ascending"), ("position", "ascending")])
    columns = [table[c].to_pylist() for c in ("step", "micro_batch", "sample_id", "score", "selected")]
    return list(zip(*columns, strict=True))


def _uninterrupted(namespace: dict, folder: Path, datamodule: L.LightningDataModule, steps: int = 10) -> list[tuple]:
    here = os.getcwd()
    os.chdir(folder)
    try:
        torch.manual_seed(0)
        model = namespace["TinyLM"]()
        namespace["trainer"](steps).fit(model, datamodule=datamodule)
    finally:
        os.chdir(here)
    return _rows(folder / "runs" / "own-trainer")


def test_the_guide_runs_and_its_resumed_run_keeps_the_uninterrupted_ledger(guide, tmp_path) -> None:
    folder, namespace = guide
    resumed = _rows(folder / "runs" / "own-trainer")
    assert len(resumed) == 10 * 16 and sum(row[4] for row in resumed) == 10 * 8
    assert resumed == _uninterrupted(namespace, tmp_path, namespace["MyData"]())  # ids, scores and choices


def test_the_guides_hugging_face_learner_gets_proxies_of_its_architecture(guide) -> None:
    from transformers import LlamaConfig

    rho = guide[1]["rho"]
    assert rho.selections == 2
    for proxy in rho.proxies.values():
        assert isinstance(proxy.module.config, LlamaConfig) and proxy.module.config.hidden_size == 32


def _ordinary(namespace: dict) -> type:
    """The guide's datamodule serving the same epoch-0 superbatches through a plain DataLoader (no state_dict)."""

    class Ordinary(namespace["MyData"]):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(list(namespace["ResumableLoader"](self.pool, n=16)), batch_size=None)

    return Ordinary


def _fit(namespace: dict, folder: Path, steps: int, ckpt_path: str | None = None, **selection) -> L.Trainer:
    """The guide's Trainer with ``HighLossSelection(**selection)`` on the ordinary loader, run in ``folder``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from selection_callbacks import HighLossSelection, SelectionLedger

    here = os.getcwd()
    os.chdir(folder)
    try:
        torch.manual_seed(0)
        trainer = L.Trainer(max_steps=steps, callbacks=[HighLossSelection(ratio=0.5, **selection), SelectionLedger("run"),
                                                        ModelCheckpoint("run/checkpoints", every_n_train_steps=5, save_top_k=-1)],
                            default_root_dir="run", logger=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(namespace["TinyLM"](), datamodule=_ordinary(namespace)(), ckpt_path=ckpt_path)
    finally:
        os.chdir(here)
    return trainer


def test_an_ordinary_loader_is_warned_about_and_a_resumed_run_replays_its_first_superbatches(guide, tmp_path) -> None:
    namespace = guide[1]
    with pytest.warns(UserWarning, match=r"HighLossSelection: the train loader \(DataLoader\) cannot restore its position, "
                                         "so a run resumed from a mid-epoch checkpoint re-serves the epoch's first"):
        _fit(namespace, tmp_path, 5)
        _fit(namespace, tmp_path, 10, ckpt_path=str(tmp_path / "run" / CHECKPOINT))
    rows = _rows(tmp_path / "run")
    def ids(lo, hi):
        return [row[2] for row in rows if lo <= row[0] < hi]
    assert len(rows) == 10 * 16 and ids(5, 10) == ids(0, 5)  # steps 6-10 re-served the superbatches of steps 1-5
    trained = [row[2] for row in rows if row[4]]
    assert len(trained) - len(set(trained)) > 0  # candidates trained twice in one epoch
    (tmp_path / "plain").mkdir()
    _fit(namespace, tmp_path / "plain", 10)
    assert [row[2] for row in _rows(tmp_path / "plain" / "run")] != [row[2] for row in rows]  # another ledger


def test_strict_resume_refuses_an_ordinary_loader_before_the_first_step(guide, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"cannot restore its position, .* Give the loader state_dict\(\) and "
                                         r"load_state_dict\(\) \(the epoch and the superbatches served; .*\)$") as info:
        _fit(guide[1], tmp_path, 5, strict_resume=True)
    assert "strict_resume=True to make this an error" not in str(info.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_guide_names_the_callbacks_a_run_wants_by_their_exported_names() -> None:
    import selection_callbacks

    text = GUIDE.read_text()
    for name in ("SelectionLedger", "SelectionDashboard", "RunRecorder", "strict_resume", "short_superbatch",
                 "per_sample_keys", "whole_batch_keys"):
        assert name in text
    for name in ("SelectionLedger", "SelectionDashboard", "RunRecorder"):
        assert name in selection_callbacks.__all__
