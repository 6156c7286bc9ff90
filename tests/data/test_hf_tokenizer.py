"""Subword tokenizers: exact per-token bytes from offsets (byte-level BPE, NFKC + lowercase), the offline
BPE command and its cache, training through ``--data.tokenizer``, and the vocabulary check."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support.toy_corpus import make_docs
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from selection_callbacks.cli import main as cli_main
from selection_callbacks.data.bpe_training import train_bpe
from selection_callbacks.data.hf_tokenizer import HFTokenizer, char_byte_offsets
from selection_callbacks.data.packing import CACHE_VERSION, PackedSplit, pack_source, source_key
from selection_callbacks.data.readers import iter_documents, source_files
from selection_callbacks.data.tokenizer import ByteTokenizer
from tests.conftest import write_jsonl

UNICODE = ["ﬁne ﬂow Ⅻ ½ café CAFÉ naïve 日本語 🙂 straße", "Ａｂｃ ＡＢＣ ｶﾀｶﾅ e\u0301 ﬃ x²", "  lead and trail  \n\n"]


def _rows(prefix: str, n: int, seed: int) -> list[dict]:
    rows = make_docs(prefix, n, seed, length=200)
    for i, r in enumerate(rows):
        r["text"] = UNICODE[i % len(UNICODE)] + " " + r["text"]
    return rows


@pytest.fixture(scope="module")
def unicode_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("unicode")
    return {split: str(write_jsonl(root / f"{split}.jsonl", _rows(split[0], n, seed)))
            for split, n, seed in (("pool", 60, 0), ("target", 12, 1), ("val", 12, 2))}


def _normalising_tokenizer(path: Path, corpus: str) -> Path:
    """Byte-level BPE behind an NFKC + lowercase normaliser (its tokens' bytes differ from the original's)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((d.text for d in iter_documents(corpus)), trainer)
    tok.save(str(path))
    return path


def _doc_spans(split: PackedSplit) -> list[tuple[int, int]]:
    ends = np.append(split.doc_start[1:], split.tokens.shape[0])
    return list(zip(split.doc_start.tolist(), ends.tolist()))


def _covered_bytes(tok: Tokenizer, text: str) -> np.ndarray:
    """Per-token original bytes recomputed from the tokenizer's own offsets: bytes of text[prev_end:end]."""
    ends = np.maximum.accumulate([e for _, e in tok.encode(text, add_special_tokens=False).offsets])
    starts = np.concatenate([[0], ends[:-1]])
    out = np.array([len(text[a:b].encode()) for a, b in zip(starts, ends)])
    out[-1] += len(text[ends[-1]:].encode())
    return out


def test_char_byte_offsets_match_utf8() -> None:
    for text in UNICODE:
        assert char_byte_offsets(text).tolist() == [len(text[:c].encode()) for c in range(len(text) + 1)]


@pytest.mark.parametrize("kind", ["byte_level_bpe", "nfkc_lowercase"])
def test_window_bytes_sum_to_the_text_they_cover(unicode_corpus, tmp_path: Path, kind: str) -> None:
    if kind == "byte_level_bpe":
        path = train_bpe([unicode_corpus["pool"]], vocab_size=400, cache_dir=tmp_path, progress=False)
    else:
        path = _normalising_tokenizer(tmp_path / "norm.json", unicode_corpus["pool"])
    tokenizer = HFTokenizer(path)
    raw = Tokenizer.from_file(str(path))
    docs = list(iter_documents(unicode_corpus["pool"]))
    split = pack_source(unicode_corpus["pool"], 16, tmp_path / "cache", tokenizer, progress=False)
    nbytes = np.asarray(split.token_nbytes, dtype=np.int64)
    spans = _doc_spans(split)
    assert len(spans) == len(docs)
    for doc, (a, b) in zip(docs, spans):
        assert nbytes[a] == 0 and split.tokens[a] == tokenizer.bos_id  # the boundary stands for no text
        assert nbytes[a + 1 : b].sum() == len(doc.text.encode())
        assert nbytes[a + 1 : b].tolist() == _covered_bytes(raw, doc.text).tolist()
    # a window's label bytes are the original bytes of the text its label tokens cover
    batch = split.batch(np.arange(len(split)))
    T = split.seq_len
    for s in range(len(split)):
        assert batch["label_bytes"][s].sum().item() == nbytes[s * T + 1 : s * T + T + 1].sum()
    if kind == "byte_level_bpe":  # no normaliser: the decoded tokens are the original bytes, by another route
        unicode_bytes = {i: len(raw.id_to_token(i)) for i in range(raw.get_vocab_size()) if i != tokenizer.bos_id}
        for s in range(len(split)):
            labels = batch["labels"][s].tolist()
            decoded = sum(unicode_bytes.get(i, 0) for i in labels)
            assert batch["label_bytes"][s].sum().item() == decoded
    else:  # the normaliser rewrites text: bytes read from the tokens alone would be wrong
        decoded = sum(len(raw.decode([int(i)]).encode()) for i in split.tokens if int(i) != tokenizer.bos_id)
        assert decoded != nbytes.sum() == sum(len(d.text.encode()) for d in docs)


def test_bpe_command_caches_beside_the_token_cache(tiny_corpus, tmp_path: Path, capsys) -> None:
    args = ["tokenizer", "--pool", tiny_corpus["pool"], "--target", tiny_corpus["target"], "--vocab-size", "300",
            "--cache-dir", str(tmp_path)]
    assert cli_main(args) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.parent.parent == tmp_path / "tokenizers" and path.name == "tokenizer.json"
    stamp = path.stat().st_mtime_ns
    assert cli_main(args) == 0
    assert Path(capsys.readouterr().out.strip()) == path and path.stat().st_mtime_ns == stamp  # reused, not retrained
    tok = HFTokenizer(path)
    assert tok.vocab_size == 300 and tok.bos_id == 0


def test_training_with_a_tokenizer_logs_exact_bpb(unicode_corpus, tmp_path: Path) -> None:
    import train

    path = train_bpe([unicode_corpus["pool"], unicode_corpus["target"]], vocab_size=400, cache_dir=tmp_path,
                     progress=False)
    base = ["fit", *(f"--data.{s}={unicode_corpus[s]}" for s in ("pool", "target", "val")),
            "--data.tokenizer", str(path), "--data.seq_len", "32", "--data.batch_size", "4", "--data.progress", "false",
            "--model.config.n_layer", "1", "--model.config.n_embd", "32", "--model.config.n_head", "2",
            "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.check_val_every_n_epoch", "null",
            "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
            "--trainer.enable_checkpointing", "false", "--selection", "RandomSelection"]
    with pytest.raises(ValueError, match=r"has 400 token ids but model.config.vocab_size=320.*vocab_size 448"):
        train.main([*base, "--model.config.vocab_size", "320", "--trainer.default_root_dir", str(tmp_path / "small")])
    train.main([*base, "--model.config.vocab_size", "448", "--trainer.default_root_dir", str(tmp_path / "run")])
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["val_bpb"] is not None and np.isfinite(metrics["val_bpb"])


def test_bpb_divides_text_nats_by_label_bytes(unicode_corpus, tmp_path: Path) -> None:
    from models.lit_gpt import LitGPT
    from selection_callbacks.nn.gpt import GPTConfig

    tokenizer = HFTokenizer(train_bpe([unicode_corpus["pool"]], vocab_size=400, cache_dir=tmp_path, progress=False))
    split = pack_source(unicode_corpus["val"], 16, tmp_path / "cache", tokenizer, progress=False)
    batch = split.batch(np.arange(len(split)))
    module = LitGPT(GPTConfig(vocab_size=448, block_size=16, n_layer=1, n_head=2, n_embd=32))
    module.text_ids = tokenizer.text_ids(448)
    module.validation_step(batch, 0)
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(module(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(),
                                                reduction="none")
    text = batch["labels"].flatten() != tokenizer.bos_id
    expected = nll[text].sum() / (np.log(2) * batch["label_bytes"].sum())
    got = module.val_byte_nats.compute() / (np.log(2) * module.val_bytes.compute())
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert module.val_bytes.compute().item() == split.token_nbytes[1 : len(split) * 16 + 1].sum()


def test_byte_tokenizer_cache_key_is_unchanged(tiny_corpus) -> None:
    """Existing byte-level caches stay valid: the key is the one packing has always computed."""
    h = hashlib.sha256(f"v{CACHE_VERSION}|byte-v1|T=32".encode())
    for f in source_files(tiny_corpus["pool"]):
        st = f.stat()
        h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    assert source_key(tiny_corpus["pool"], 32, ByteTokenizer(), None) == h.hexdigest()[:20]


def test_unknown_boundary_token_and_missing_file(tmp_path: Path, unicode_corpus) -> None:
    path = train_bpe([unicode_corpus["pool"]], vocab_size=300, cache_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="boundary token '<pad>' is not in"):
        HFTokenizer(path, boundary_token="<pad>")
    with pytest.raises(FileNotFoundError, match="selection-callbacks tokenizer"):
        HFTokenizer(tmp_path / "missing.json")


def test_ledger_maps_sample_ids_to_documents_with_the_runs_tokenizer(unicode_corpus, tmp_path: Path) -> None:
    from selection_callbacks.callbacks.ledger_writer import _pool_source
    from selection_callbacks.cli.ledger import _doc_lookup
    from selection_callbacks.data.datamodule import PoolDataModule

    path = train_bpe([unicode_corpus["pool"]], vocab_size=400, cache_dir=tmp_path, progress=False)
    dm = PoolDataModule(unicode_corpus["pool"], unicode_corpus["target"], unicode_corpus["val"], seq_len=16,
                        cache_dir=str(tmp_path / "cache"), tokenizer=str(path), progress=False)
    meta = _pool_source(dm)
    assert meta["tokenizer"] == str(path) and meta["boundary_token"] == "<|endoftext|>"
    lookup, why = _doc_lookup(meta)
    assert why == ""
    split = pack_source(unicode_corpus["pool"], 16, tmp_path / "cache", HFTokenizer(path), progress=False)
    assert [lookup(s) for s in range(0, len(split), 7)] == [split.sample_doc_ids(s) for s in range(0, len(split), 7)]
