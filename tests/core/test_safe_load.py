"""Files a user hands over load without running code: a crafted checkpoint whose pickle would create a
file is refused (by the helper and by train.py's resume), with and without TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD
set, and the file is never created."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

import train
from selection_callbacks.core.safe_load import FORCE_PICKLE_VARIABLE, UnsafeLoadError, load_user_file
from selection_callbacks.scoring.reference import load_reference
from tests.test_train_cli import ROOT, TINY, _data_args


class CreatesAFile:
    """Pickles as a call to ``open(path, "w")``: unpickling it with the full loader creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def crafted(tmp_path: Path, marker: str) -> tuple[Path, Path]:
    """A checkpoint with tensors and the file-creating object, and the file it would create."""
    made = tmp_path / marker
    path = tmp_path / f"{marker}.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "payload": CreatesAFile(made)}, path)
    return path, made


def test_the_crafted_checkpoint_creates_its_file_under_the_full_pickle_loader(tmp_path) -> None:
    path, made = crafted(tmp_path, "control")
    torch.load(path, weights_only=False)  # what the project never does with a user's file
    assert made.exists()


@pytest.mark.parametrize("forced", [False, True])
def test_a_crafted_checkpoint_is_refused_and_creates_nothing(tmp_path, monkeypatch, forced) -> None:
    path, made = crafted(tmp_path, "helper")
    if forced:
        monkeypatch.setenv(FORCE_PICKLE_VARIABLE, "1")
    message = f"{FORCE_PICKLE_VARIABLE} is set.*unset it" if forced else "holds objects that loading would have to build"
    with pytest.raises(UnsafeLoadError, match=message):
        load_user_file(path, "the reference checkpoint")
    assert not made.exists()


def test_plain_checkpoints_load_and_forced_pickle_refuses_them_too(tmp_path, monkeypatch) -> None:
    path = tmp_path / "plain.pt"
    torch.save({"w": torch.arange(3), "meta": {"step": 4, "name": "x"}}, path)
    loaded = load_user_file(path, "a tensor table")
    assert torch.equal(loaded["w"], torch.arange(3)) and loaded["meta"] == {"step": 4, "name": "x"}
    monkeypatch.setenv(FORCE_PICKLE_VARIABLE, "true")
    with pytest.raises(UnsafeLoadError, match=f"refusing to load a tensor table .*{FORCE_PICKLE_VARIABLE}"):
        load_user_file(path, "a tensor table")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        monkeypatch.delenv(FORCE_PICKLE_VARIABLE)
        load_user_file(tmp_path / "absent.pt", "a tensor table")


@pytest.mark.parametrize("forced", [False, True])
def test_train_resume_refuses_a_crafted_checkpoint(tiny_corpus, tmp_path, monkeypatch, forced) -> None:
    path, made = crafted(tmp_path, "resume")
    if forced:
        monkeypatch.setenv(FORCE_PICKLE_VARIABLE, "1")
    args = ["fit", "--config", str(ROOT / "configs/scale/cpu-tiny.yaml"), *_data_args(tiny_corpus), *TINY,
            "--data.ratio", "1", "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(tmp_path / "run"), "--ckpt_path", str(path)]
    error = UnsafeLoadError if forced else pickle.UnpicklingError
    with pytest.raises(error, match=f"{FORCE_PICKLE_VARIABLE} is set" if forced else "Weights only load failed"):
        train.main(args)
    assert not made.exists()


@pytest.mark.parametrize("forced", [False, True])
def test_a_crafted_reference_checkpoint_is_refused_and_creates_nothing(tmp_path, monkeypatch, forced) -> None:
    path, made = crafted(tmp_path, "reference")
    if forced:
        monkeypatch.setenv(FORCE_PICKLE_VARIABLE, "1")
    with pytest.raises(UnsafeLoadError, match=f"{FORCE_PICKLE_VARIABLE} is set" if forced else "is refused"):
        load_reference(path)
    assert not made.exists()


def test_loading_leaves_the_globally_allowed_classes_allowed(tmp_path) -> None:
    """A class allowed for the whole process (GPTConfig, by its module) stays allowed after a load that names it too."""
    from selection_callbacks.nn.gpt import GPTConfig

    path = tmp_path / "config.pt"
    torch.save({"config": GPTConfig(n_layer=1)}, path)
    assert load_user_file(path, "a config", [GPTConfig])["config"] == GPTConfig(n_layer=1)
    assert GPTConfig in torch.serialization.get_safe_globals()
    assert torch.load(path, weights_only=True)["config"] == GPTConfig(n_layer=1)
