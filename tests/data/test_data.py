"""Pool data: readers, packing, stable ids, resumable loader, rank sharding, subsets, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from support.toy_corpus import make_docs

from selection_callbacks.data.datamodule import PoolDataModule, candidates_per_rank
from selection_callbacks.data.loader import SuperbatchLoader
from selection_callbacks.data.packing import pack_source
from selection_callbacks.data.readers import DataSourceError, iter_documents
from selection_callbacks.data.subset import SubsetError, write_subset
from selection_callbacks.data.tokenizer import ByteTokenizer
from selection_callbacks.methods import RandomSelection
from tests.conftest import write_jsonl


def _dm(corpus: dict[str, str], **kw) -> PoolDataModule:
    args = dict(seq_len=32, batch_size=4, ratio=0.5, progress=False)
    args.update(kw)
    dm = PoolDataModule(corpus["pool"], corpus["target"], corpus["val"], **args)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_readers_agree_across_formats(tmp_path: Path) -> None:
    rows = make_docs("d", 6, 0)
    write_jsonl(tmp_path / "a.jsonl", rows)
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in ("id", "text", "domain")}), tmp_path / "a.parquet")
    folder = tmp_path / "txt" / "prose"
    folder.mkdir(parents=True)
    for r in rows:
        (folder / f"{r['id']}.txt").write_text(r["text"])
    from_jsonl = list(iter_documents(tmp_path / "a.jsonl"))
    from_parquet = list(iter_documents(tmp_path / "a.parquet"))
    from_folder = list(iter_documents(tmp_path / "txt"))
    assert from_jsonl == from_parquet
    assert [d.text for d in from_folder] == [r["text"] for r in rows]
    assert from_folder[0].id == "prose/d0.txt"
    assert {d.domain for d in from_folder} == {"prose"}


def test_packing_layout_and_domains(tiny_corpus, tmp_path: Path) -> None:
    split = pack_source(tiny_corpus["pool"], 32, tmp_path, progress=False)
    tok = ByteTokenizer()
    docs = list(iter_documents(tiny_corpus["pool"]))
    stream = np.concatenate([tok.encode_document(d.text) for d in docs])
    assert len(split) == (len(stream) - 1) // 32
    batch = split.batch(np.array([0, 5, len(split) - 1]))
    for row, s in enumerate([0, 5, len(split) - 1]):
        assert batch["input_ids"][row].tolist() == stream[s * 32 : s * 32 + 32].tolist()
        assert batch["labels"][row].tolist() == stream[s * 32 + 1 : s * 32 + 33].tolist()
    # a sample inside one noise document is labelled noise
    noise_doc = next(i for i, d in enumerate(docs) if d.domain == "noise")
    s = int(split.doc_start[noise_doc] // 32) + 2
    assert split.domain_names[split.sample_domain[s]] == "noise"
    assert split.sample_doc_ids(s) == [docs[noise_doc].id]


def test_ids_stable_across_runs_and_workers(tiny_corpus, tmp_path: Path) -> None:
    a = pack_source(tiny_corpus["pool"], 32, tmp_path / "c1", progress=False)
    b = pack_source(tiny_corpus["pool"], 32, tmp_path / "c2", progress=False)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.sample_domain, b.sample_domain)
    ids = np.arange(len(a))
    streams = []
    for workers in (0, 2):
        loader = SuperbatchLoader(a, ids, 8, seed=3, num_workers=workers)
        streams.append([batch["sample_id"].tolist() for batch in loader])
    assert streams[0] == streams[1]
    flat = sum(streams[0], [])
    assert len(set(flat)) == len(flat) == len(streams[0]) * 8  # each id at most once per epoch


def test_seed_changes_order_not_ids(tiny_corpus, tmp_path: Path) -> None:
    split = pack_source(tiny_corpus["pool"], 32, tmp_path, progress=False)
    ids = np.arange(len(split))
    first = next(iter(SuperbatchLoader(split, ids, 8, seed=0)))["sample_id"]
    again = next(iter(SuperbatchLoader(split, ids, 8, seed=0)))["sample_id"]
    other = next(iter(SuperbatchLoader(split, ids, 8, seed=1)))["sample_id"]
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_loader_resumes_mid_epoch_and_across_epochs(tiny_corpus, tmp_path: Path) -> None:
    split = pack_source(tiny_corpus["pool"], 32, tmp_path, progress=False)
    ids = np.arange(len(split))
    full = SuperbatchLoader(split, ids, 8, seed=7)
    uninterrupted = [b["sample_id"].tolist() for _ in range(2) for b in full]
    part = SuperbatchLoader(split, ids, 8, seed=7)
    seen = []
    for i, b in enumerate(part):
        seen.append(b["sample_id"].tolist())
        if i == 4:
            break
    state = part.state_dict()
    resumed = SuperbatchLoader(split, ids, 8, seed=7)
    resumed.load_state_dict(state)
    seen += [b["sample_id"].tolist() for b in resumed]
    seen += [b["sample_id"].tolist() for b in resumed]  # the next epoch
    assert seen == uninterrupted
    assert uninterrupted[: len(full)] != uninterrupted[len(full) :]  # epochs reshuffle


def test_rank_shards_concatenate_to_single_process(tiny_corpus, tmp_path: Path) -> None:
    split = pack_source(tiny_corpus["pool"], 32, tmp_path, progress=False)
    ids = np.arange(len(split))
    single = [b["sample_id"] for b in SuperbatchLoader(split, ids, 16, seed=2)]
    ranks = [[b["sample_id"] for b in SuperbatchLoader(split, ids, 8, seed=2, rank=r, world_size=2)] for r in (0, 1)]
    assert len(single) == len(ranks[0]) == len(ranks[1])
    for s, r0, r1 in zip(single, *ranks):
        assert torch.equal(s, torch.cat([r0, r1]))


def test_datamodule_superbatch_and_target(tiny_corpus) -> None:
    dm = _dm(tiny_corpus)
    batch = next(iter(dm.train_dataloader()))
    assert dm.superbatch_size == 8 and batch["input_ids"].shape == (8, 32)
    assert set(batch) == {"input_ids", "labels", "sample_id", "domain"}
    assert set(dm.domain_names) == {"prose", "noise"}
    target = dm.target_batch(5, np.random.default_rng(0))
    assert target["input_ids"].shape == (5, 32)
    val = next(iter(dm.val_dataloader()))
    assert val["input_ids"].shape[1] == 32


def test_subset_by_sample_id_and_weight(tiny_corpus, tmp_path: Path) -> None:
    path = write_subset(tmp_path / "s.parquet", "sample_id", list(range(0, 40, 2)), weights=np.full(20, 2.0))
    dm = _dm(tiny_corpus, subset=str(path))
    seen = torch.cat([b["sample_id"] for b in dm.train_dataloader()])
    assert set(seen.tolist()) <= set(range(0, 40, 2))
    assert len(seen) == 40  # weight 2 repeats each id twice per epoch
    assert torch.bincount(seen).max() == 2


def test_subset_by_doc_id_repacks_only_those_docs(tiny_corpus, tmp_path: Path) -> None:
    docs = [d.id for d in iter_documents(tiny_corpus["pool"]) if d.domain == "prose"][:30]
    path = write_subset(tmp_path / "d.parquet", "doc_id", docs)
    dm = _dm(tiny_corpus, subset=str(path))
    assert dm.splits["pool"].doc_ids.tolist() == docs
    assert dm.domain_names == ["prose"]


@pytest.mark.parametrize(
    "kind, ids, match",
    [("doc_id", ["p0", "no-such-doc"], "does not contain"), ("sample_id", [0, 10**7], "beyond the pool")],
)
def test_subset_unknown_ids_fail(tiny_corpus, tmp_path: Path, kind, ids, match) -> None:
    path = write_subset(tmp_path / "bad.parquet", kind, ids)
    with pytest.raises((SubsetError, DataSourceError), match=match):
        _dm(tiny_corpus, subset=str(path))


def test_subset_file_without_id_column(tiny_corpus, tmp_path: Path) -> None:
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "x.parquet")
    with pytest.raises(SubsetError, match="'doc_id' or 'sample_id'"):
        _dm(tiny_corpus, subset=str(tmp_path / "x.parquet"))


def test_bad_sources(tiny_corpus, tmp_path: Path) -> None:
    with pytest.raises(DataSourceError, match="does not exist"):
        _dm({**tiny_corpus, "pool": str(tmp_path / "missing.jsonl")})
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataSourceError, match="no documents"):
        _dm({**tiny_corpus, "pool": str(tmp_path / "empty.jsonl")})
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataSourceError, match="not valid JSON"):
        _dm({**tiny_corpus, "pool": str(tmp_path / "broken.jsonl")})
    (tmp_path / "notext.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataSourceError, match="'text' field"):
        _dm({**tiny_corpus, "pool": str(tmp_path / "notext.jsonl")})
    write_jsonl(tmp_path / "short.jsonl", [{"text": "too short"}])
    with pytest.raises(DataSourceError, match="lower data.seq_len"):
        _dm({**tiny_corpus, "val": str(tmp_path / "short.jsonl")})
    (tmp_path / "corrupt.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataSourceError, match="cannot read parquet"):
        _dm({**tiny_corpus, "pool": str(tmp_path / "corrupt.parquet")})


@pytest.mark.parametrize("ratio", [0.0, -0.5, 1.5])
def test_ratio_outside_unit_interval(ratio: float) -> None:
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        candidates_per_rank(16, ratio)


@pytest.mark.parametrize("k", [1, 3, 16, 64])
@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.3, 1 / 3, 0.5, 0.7, 1.0])
def test_callback_keeps_exactly_the_datamodule_k(k: int, ratio: float) -> None:
    n = candidates_per_rank(k, ratio)
    assert RandomSelection(ratio=ratio).keep(n) == k


def _write_bin(path: Path, tokens: np.ndarray, llmc: bool) -> Path:
    with open(path, "wb") as f:
        if llmc:
            header = np.zeros(256, dtype=np.int32)
            header[:3] = [20240520, 1, tokens.size]
            f.write(header.tobytes())
        f.write(tokens.astype(np.uint16).tobytes())
    return path


@pytest.mark.parametrize("llmc", [False, True])
def test_token_bin_pools(tmp_path: Path, llmc: bool) -> None:
    from selection_callbacks.data.token_bin import load_token_bin

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50000, 4000)
    tokens[[99, 1999, 3999]] = 50256  # three documents, each ended by EOT
    split = load_token_bin(_write_bin(tmp_path / "p.bin", tokens, llmc), 32, tmp_path / "cache", 50256)
    assert len(split) == (4000 - 1) // 32 and split.doc_start.tolist() == [0, 100, 2000]
    batch = split.batch(np.array([3]))
    assert batch["input_ids"][0].tolist() == tokens[96:128].tolist()
    assert batch["labels"][0].tolist() == tokens[97:129].tolist()
    assert split.sample_doc_ids(3) == ["p.bin:0", "p.bin:1"]


def test_train_on_token_bins(tmp_path: Path) -> None:
    import train

    rng = np.random.default_rng(0)
    paths = {s: _write_bin(tmp_path / f"{s}.bin", rng.integers(0, 500, n), llmc=False)
             for s, n in (("pool", 20000), ("target", 3000), ("val", 3000))}
    np.save(tmp_path / "bytes.npy", np.full(500, 2.0))
    args = ["fit", "--data.pool", str(paths["pool"]), "--data.target", str(paths["target"]), "--data.val",
            str(paths["val"]), "--data.vocab_size", "500", "--data.seq_len", "32", "--data.batch_size", "4",
            "--model.config.vocab_size", "512", "--model.config.n_layer", "1", "--model.config.n_embd", "32",
            "--model.config.n_head", "2", "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
            "--trainer.check_val_every_n_epoch", "null", "--trainer.enable_progress_bar", "false",
            "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
            "--trainer.default_root_dir", str(tmp_path / "run"), "--selection", "RandomSelection"]
    train.main(args)
    loss_only = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert loss_only["curve_metric"] == "val_loss" and loss_only["val_bpb"] is None and len(loss_only["curve"]) == 2
    train.main(args + ["--data.token_bytes", str(tmp_path / "bytes.npy"), "--trainer.default_root_dir", str(tmp_path / "r2")])
    with_bytes = json.loads((tmp_path / "r2" / "metrics.json").read_text())
    # 2 bytes per token: bpb = nats / (ln 2 · 2) per token
    assert with_bytes["val_bpb"] == pytest.approx(with_bytes["val_loss"] / (2 * np.log(2)), rel=1e-5)


def test_mixed_bin_and_text_splits_are_rejected(tiny_corpus, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="all be .bin"):
        PoolDataModule(tiny_corpus["pool"], str(tmp_path / "t.bin"), tiny_corpus["val"])
    with pytest.raises(ValueError, match="data.vocab_size"):
        PoolDataModule(str(tmp_path / "p.bin"), str(tmp_path / "t.bin"), str(tmp_path / "v.bin"))


def test_fractional_weights_keep_their_expected_share(tiny_corpus, tmp_path: Path) -> None:
    from selection_callbacks.data.subset import repeat_counts

    w = np.full(100, 0.5)
    counts = np.stack([repeat_counts(w, np.random.default_rng(s)) for s in range(400)])
    assert set(counts.sum(1).tolist()) <= {50}  # Σw = 50 exactly
    assert np.allclose(counts.mean(0), 0.5, atol=0.1)
    w = np.full(100, 1.9)
    assert set(repeat_counts(w, np.random.default_rng(0)).tolist()) <= {1, 2}
    path = write_subset(tmp_path / "half.parquet", "sample_id", list(range(64)), weights=np.full(64, 0.5))
    dm = _dm(tiny_corpus, subset=str(path))
    assert len(dm.train_dataloader()) == 4  # 32 sequences per epoch / N=8
    assert sum(b["sample_id"].numel() for b in dm.train_dataloader()) == 32
