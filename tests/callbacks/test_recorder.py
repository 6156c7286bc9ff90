"""RunRecorder's Dynamo graph count: recorded at each validation for a compiled learner, absent for an eager one."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from selection_callbacks.callbacks.recorder import RunRecorder


def _validate(recorder: RunRecorder, trainer: SimpleNamespace, module: nn.Module, tokens: int) -> dict:
    recorder.update_tokens = tokens
    recorder.on_validation_start(trainer, module)
    recorder.on_validation_end(trainer, module)
    return json.loads((Path(trainer.default_root_dir) / "metrics.json").read_text())


def _trainer(tmp_path: Path) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(fn="fit"), sanity_checking=False, callbacks=[], is_global_zero=True,
                           global_step=0, default_root_dir=str(tmp_path), callback_metrics={"val/bpb": torch.tensor(3.0)})


def test_dynamo_graphs_are_recorded_for_a_compiled_learner(tmp_path: Path) -> None:
    learner = nn.Sequential(nn.Linear(4, 4))
    learner[0].compile()  # in place, as the learners compile their blocks (lazy: nothing is traced here)
    recorder, trainer = RunRecorder(), _trainer(tmp_path)
    recorder.on_train_start(trainer, learner)
    start = counters["stats"]["unique_graphs"]
    assert _validate(recorder, trainer, learner, 10)["dynamo_graphs"] == [[10, start]]
    counters["stats"]["unique_graphs"] += 2  # two graphs compiled between the validations
    try:
        assert _validate(recorder, trainer, learner, 20)["dynamo_graphs"] == [[10, start], [20, start + 2]]
    finally:
        counters["stats"]["unique_graphs"] -= 2


def test_an_eager_learner_records_no_graph_count(tmp_path: Path) -> None:
    learner = nn.Sequential(nn.Linear(4, 4))
    recorder, trainer = RunRecorder(), _trainer(tmp_path)
    recorder.on_train_start(trainer, learner)
    assert "dynamo_graphs" not in _validate(recorder, trainer, learner, 10)
