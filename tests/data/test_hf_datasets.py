"""Hugging Face ``datasets`` pools: saved datasets, arrow shards, configurable columns, streaming with a seeded
shuffle buffer, and a streamed run killed mid-epoch and resumed from its Lightning checkpoint."""

from __future__ import annotations

from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from support.toy_corpus import make_docs

from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.data.readers import Columns, DataSourceError, iter_documents, stream_documents
from selection_callbacks.data.stream_loader import StreamingSuperbatchLoader
from selection_callbacks.data.tokenizer import ByteTokenizer
from selection_callbacks.offline.common.corpus import load_corpus
from tests.conftest import write_jsonl
from tests.support.resume_fit import SeenIds, fit_recording_ids


@pytest.fixture(autouse=True)
def _offline_datasets(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_datasets"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _save(rows: list[dict], path: Path, **rename: str) -> str:
    ds = datasets.Dataset.from_list(rows)
    if rename:
        ds = ds.rename_columns(rename)
    ds.save_to_disk(str(path))
    return str(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """pool/target/val saved with ``save_to_disk``, their columns renamed (body, source, key)."""
    root = tmp_path_factory.mktemp("saved")
    rename = dict(text="body", domain="source", id="key")
    return {
        "pool": _save(make_docs("p", 160, 0), root / "pool", **rename),
        "target": _save(make_docs("t", 30, 1, ("prose",)), root / "target", **rename),
        "val": _save(make_docs("v", 30, 2, ("prose",)), root / "val", **rename),
    }


POOL_COLUMNS = Columns(text="body", id="key", domain="source")
COLUMN_ARGS = dict(text_column="body", id_column="key", domain_column="source")


def test_every_format_reads_the_same_documents(tmp_path: Path) -> None:
    rows = make_docs("d", 12, 0)
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in ("id", "text", "domain")}), tmp_path / "d.parquet")
    saved = _save(rows, tmp_path / "saved")
    arrow = next(Path(saved).glob("*.arrow"))
    expected = list(iter_documents(jsonl))
    for source in (tmp_path / "d.parquet", saved, arrow):
        assert list(iter_documents(source)) == expected
        assert list(stream_documents(source)) == expected
    assert list(stream_documents(jsonl)) == expected
    assert list(stream_documents(saved, skip=5)) == expected[5:]
    assert load_corpus(saved).ids.tolist() == load_corpus(jsonl).ids.tolist()  # offline selectors read it too


def test_columns_are_configurable_and_named_in_errors(saved, tmp_path: Path) -> None:
    docs = list(iter_documents(saved["pool"], POOL_COLUMNS))
    assert docs[0].id == "p0" and {d.domain for d in docs} == {"prose", "noise"}
    no_domain = list(iter_documents(saved["pool"], Columns(text="body", id=None, domain=None)))
    assert no_domain[3].id == "pool:3" and {d.domain for d in no_domain} == {"default"}
    with pytest.raises(DataSourceError, match="no 'text' column.*data.text_column"):
        list(iter_documents(saved["pool"]))
    with pytest.raises(DataSourceError, match="no 'text' column"):
        list(stream_documents(saved["pool"]))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(make_docs("x", 3, 0))}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataSourceError, match="DatasetDict.*pass one split's folder"):
        list(iter_documents(tmp_path / "dd"))
    assert len(list(iter_documents(tmp_path / "dd" / "train"))) == 3


def _epoch_windows(loader) -> dict[int, tuple[int, ...]]:
    out = {}
    for batch in loader:
        for sid, row in zip(batch["sample_id"].tolist(), batch["input_ids"].tolist()):
            assert sid not in out
            out[sid] = tuple(row)
    return out


def _datamodules(saved: dict[str, str], tmp_path: Path, **kw) -> tuple[PoolDataModule, PoolDataModule]:
    out = []
    for streaming in (False, True):
        dm = PoolDataModule(saved["pool"], saved["target"], saved["val"], seq_len=32, progress=False,
                            cache_dir=str(tmp_path), streaming=streaming, shuffle_buffer=16, **COLUMN_ARGS, **kw)
        dm.prepare_data()
        dm.setup("fit")
        out.append(dm)
    return out[0], out[1]


def test_saved_dataset_and_its_stream_yield_the_same_samples_over_an_epoch(saved, tmp_path: Path) -> None:
    """One sequence per superbatch, so no epoch drops a remainder: both serve every window once, same id → same tokens."""
    packed, streamed = _datamodules(saved, tmp_path, batch_size=1, ratio=1.0)
    a, b = packed.train_dataloader(), streamed.train_dataloader()
    assert len(a) == len(b) == len(packed.splits["pool"]) and streamed.domain_names == packed.domain_names
    seen_a, seen_b = _epoch_windows(a), _epoch_windows(b)
    assert set(seen_a) == set(seen_b) == set(range(len(a)))
    assert all(seen_a[s] == seen_b[s] for s in seen_a)
    assert list(seen_b) != sorted(seen_b)  # the buffer shuffles


def test_streamed_superbatches_follow_the_contract(saved, tmp_path: Path) -> None:
    packed, streamed = _datamodules(saved, tmp_path, batch_size=4, ratio=0.5)
    split = packed.splits["pool"]
    loader = streamed.train_dataloader()
    assert len(loader) == len(packed.train_dataloader()) == len(split) // 8
    for batch in list(loader)[:5]:
        ids = batch["sample_id"].numpy()
        assert batch["input_ids"].shape == (8, 32)
        assert torch.equal(batch["labels"], split.batch(ids)["labels"])
        assert torch.equal(batch["domain"], torch.from_numpy(split.sample_domain[ids]))


def test_stream_order_depends_on_seed_and_epoch_only(saved, tmp_path: Path) -> None:
    def loader(seed: int) -> StreamingSuperbatchLoader:
        return StreamingSuperbatchLoader(saved["pool"], ByteTokenizer(), 32, 8, tmp_path, seed=seed, buffer_size=16,
                                         columns=POOL_COLUMNS)

    epochs = [[b["sample_id"].tolist() for b in loader(3)] for _ in range(2)]
    again = loader(3)
    two = [[b["sample_id"].tolist() for b in again] for _ in range(2)]
    assert epochs[0] == epochs[1] == two[0] and two[0] != two[1]  # reproducible; a new epoch reshuffles
    assert [b["sample_id"].tolist() for b in loader(4)] != epochs[0]


def test_stream_state_dict_resumes_mid_epoch_and_across_epochs(saved, tmp_path: Path) -> None:
    def loader() -> StreamingSuperbatchLoader:
        return StreamingSuperbatchLoader(saved["pool"], ByteTokenizer(), 32, 4, tmp_path, seed=7, buffer_size=16,
                                         columns=POOL_COLUMNS)

    full = loader()
    uninterrupted = [b["sample_id"].tolist() for _ in range(2) for b in full]
    part, seen = loader(), []
    for i, b in enumerate(part):
        seen.append(b["sample_id"].tolist())
        if i == 6:
            break
    state = part.state_dict()
    assert state["stream"]["docs_read"] < 160  # mid-stream: the position, not a replay from the start
    resumed = loader()
    resumed.load_state_dict(torch.load(_saved(state, tmp_path), weights_only=True))
    seen += [b["sample_id"].tolist() for b in resumed]
    seen += [b["sample_id"].tolist() for b in resumed]
    assert seen == uninterrupted


def _saved(state: dict, tmp_path: Path) -> Path:
    torch.save(state, tmp_path / "state.pt")
    return tmp_path / "state.pt"


def _fit(saved: dict[str, str], root: Path, steps: int, ckpt_every: int | None = None,
         ckpt_path: str | None = None) -> SeenIds:
    dm = PoolDataModule(saved["pool"], saved["target"], saved["val"], seq_len=32, batch_size=4, ratio=0.5, seed=3,
                        progress=False, streaming=True, shuffle_buffer=16, **COLUMN_ARGS)
    return fit_recording_ids(dm, root, steps, ckpt_every, ckpt_path)


def test_streamed_run_killed_mid_epoch_and_resumed_selects_what_the_full_run_selects(saved, tmp_path: Path) -> None:
    full = _fit(saved, tmp_path / "a", steps=8)
    _fit(saved, tmp_path / "b", steps=5, ckpt_every=3)  # "killed" after step 5; the last checkpoint is step 3
    resumed = _fit(saved, tmp_path / "c", steps=8, ckpt_path=str(tmp_path / "b" / "epoch=0-step=3.ckpt"))
    assert len(full.ids) == 8 and all(len(ids) == 4 for ids in full.ids)
    assert resumed.ids == full.ids[3:]


def test_streaming_rejects_a_subset(saved) -> None:
    with pytest.raises(ValueError, match="data.subset needs a packed pool"):
        PoolDataModule(saved["pool"], saved["target"], saved["val"], streaming=True, subset="s.parquet")
