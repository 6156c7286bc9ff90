"""The pool datamodule: pool superbatches for training, target batches for selectors, val for evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from selection_callbacks.data.cache import default_cache_dir
from selection_callbacks.data.hf_tokenizer import HFTokenizer
from selection_callbacks.data.loader import SuperbatchLoader
from selection_callbacks.data.packing import PackedSplit, pack_source
from selection_callbacks.data.readers import Columns, DataSourceError, check_source
from selection_callbacks.data.stream_loader import DEFAULT_BUFFER, StreamCount, StreamingSuperbatchLoader, count_stream
from selection_callbacks.data.subset import SubsetError, read_subset
from selection_callbacks.data.token_bin import PretokenizedTokenizer, load_token_bin
from selection_callbacks.data.tokenizer import ByteTokenizer


def candidates_per_rank(batch_size: int, ratio: float) -> int:
    """N such that keeping ``ratio·N`` gives exactly K = ``batch_size`` sequences."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"selection ratio must lie in (0, 1], got {ratio}; ratio = K/N is the kept fraction")
    if batch_size < 1:
        raise ValueError(f"batch_size (K, sequences trained per micro-batch) must be ≥ 1, got {batch_size}")
    return round(batch_size / ratio)



class _SampleDataset(Dataset):
    def __init__(self, split: PackedSplit, ids: np.ndarray) -> None:
        self.split, self.ids = split, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.split.batch(self.ids[i : i + 1]).items()}


class PoolDataModule(L.LightningDataModule):
    """Pool, target and val splits packed into fixed-length sequences.

    Training yields superbatches of N = K/ratio pool sequences as dicts (``input_ids``,
    ``labels`` [N, T], ``sample_id``, ``domain`` [N], and ``label_bytes`` [N, T] under a subword
    tokenizer, declared in :attr:`per_sample_keys`); a :class:`SelectionCallback` keeps K.
    Selectors may read the target split (:meth:`target_batch`); only evaluation reads val.

    Example::

        dm = PoolDataModule("data/default/pool.jsonl", "data/default/target.jsonl",
                            "data/default/val.jsonl", seq_len=128, batch_size=16, ratio=0.5)

    With ``streaming=True`` the pool is read through ``datasets`` streaming and packed on the fly
    (:mod:`~selection_callbacks.data.stream_loader`: source-order sample ids, a seeded shuffle buffer);
    target and val are still packed and cached.

    Args:
        pool: candidate documents (jsonl, parquet or arrow files, a folder of text files, or a
            folder written by ``datasets``' ``save_to_disk``).
        target: documents selectors may look at.
        val: evaluation documents; no selector reads them.
        seq_len: T, tokens per training sequence.
        batch_size: K, sequences trained per micro-batch (per rank).
        ratio: kept fraction ρ = K/N of each superbatch.
        seed: shuffling seed (same seed, same candidate stream).
        subset: optional subset file (parquet, ``doc_id`` or ``sample_id`` [+ ``weight``]).
        val_batch_size: sequences per validation batch.
        val_samples: evaluate on this many val sequences (evenly spaced); all if None.
        cache_dir: where packed tokens are cached (default ``$SELECTION_CACHE`` or ~/.cache).
        num_workers: loader workers.
        progress: show tokenisation progress bars.
        vocab_size: for pre-tokenized ``.bin`` splits: the token vocabulary size.
        token_bytes: for ``.bin`` splits: ``.npy`` of UTF-8 bytes per token id (enables bpb).
        eot_id: for ``.bin`` splits: the end-of-text id that separates documents.
        tokenizer: a ``tokenizer.json`` (Hugging Face ``tokenizers``; ``selection-callbacks tokenizer``
            trains one); None = bytes.
        boundary_token: the tokenizer's special token written before each document (default: the
            first of ``<|endoftext|>``, ``</s>``, ``<s>``, ... it has).
        text_column: the row field holding the text.
        id_column: the row field holding a stable document id (absent: ``<file>:<row>``).
        domain_column: the row field holding the domain (None or absent: ``"default"``).
        streaming: stream the pool instead of packing it (no ``subset``).
        shuffle_buffer: windows in the streamed pool's shuffle buffer.
    """

    per_sample_keys = ("label_bytes",)
    """Per-sample entries of its superbatches besides the contract's: the selection cuts them to the kept rows."""

    def __init__(
        self,
        pool: str,
        target: str,
        val: str,
        seq_len: int = 128,
        batch_size: int = 16,
        ratio: float = 0.5,
        seed: int = 0,
        subset: str | None = None,
        val_batch_size: int = 64,
        val_samples: int | None = None,
        cache_dir: str | None = None,
        num_workers: int = 0,
        progress: bool = True,
        vocab_size: int | None = None,
        token_bytes: str | None = None,
        eot_id: int = 50256,
        tokenizer: str | None = None,
        boundary_token: str | None = None,
        text_column: str = "text",
        id_column: str | None = "id",
        domain_column: str | None = "domain",
        streaming: bool = False,
        shuffle_buffer: int = DEFAULT_BUFFER,
    ) -> None:
        super().__init__()
        self.superbatch_size = candidates_per_rank(batch_size, ratio)
        if seq_len < 1:
            raise ValueError(f"seq_len must be ≥ 1, got {seq_len}")
        self.paths = {"pool": pool, "target": target, "val": val}
        self.seq_len, self.batch_size, self.ratio, self.seed = seq_len, batch_size, ratio, seed
        self.subset_path = subset
        self.val_batch_size, self.val_samples = val_batch_size, val_samples
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.num_workers, self.progress = num_workers, progress
        binary = [str(p).endswith(".bin") for p in self.paths.values()]
        if any(binary) and not all(binary):
            raise ValueError("pool, target and val must all be .bin token files or all be text sources")
        self.pretokenized = all(binary)
        if self.pretokenized:
            if vocab_size is None:
                raise ValueError("pre-tokenized .bin splits need data.vocab_size (e.g. 50257 for GPT-2 ids)")
            if tokenizer is not None or streaming:
                raise ValueError(".bin splits are already tokenized; drop data.tokenizer / data.streaming")
            self.tokenizer = PretokenizedTokenizer(vocab_size, token_bytes)
        elif tokenizer is not None:
            self.tokenizer = HFTokenizer(tokenizer, boundary_token)
        else:
            self.tokenizer = ByteTokenizer()
        if streaming and subset:
            raise ValueError("data.subset needs a packed pool (sample or document ids to look up); drop data.streaming")
        self.columns = Columns(text=text_column, id=id_column, domain=domain_column)
        self.streaming, self.shuffle_buffer = streaming, shuffle_buffer
        self._count: StreamCount | None = None
        self.eot_id = eot_id
        self.splits: dict[str, PackedSplit] = {}
        self._train_ids: np.ndarray | None = None
        self._train_weights: np.ndarray | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def domain_names(self) -> list[str]:
        """Names of the ``domain`` codes in training batches."""
        if self.streaming:
            return self._stream_count().domain_names
        return self.splits["pool"].domain_names

    def _stream_count(self) -> StreamCount:
        """The streamed pool's windows and domains: counted (or read from the cache) once per datamodule,
        since ``domain_names`` is read on every training step."""
        if self._count is None:
            self._count = count_stream(self.paths["pool"], self.seq_len, self.tokenizer, self.cache_dir, self.columns)
        return self._count

    def _pack(self, name: str, doc_filter: list[str] | None = None) -> PackedSplit:
        if self.pretokenized:
            if doc_filter is not None:
                raise SubsetError("doc_id subsets need a text pool; for .bin pools use a sample_id subset")
            return load_token_bin(self.paths[name], self.seq_len, self.cache_dir, self.eot_id, name=name)
        return pack_source(
            self.paths[name], self.seq_len, self.cache_dir, self.tokenizer, doc_filter, name=name,
            progress=self.progress, columns=self.columns,
        )

    def _split_names(self) -> list[str]:
        """The splits packed into the token cache: all three, or target and val when the pool streams."""
        return [name for name in self.paths if not (self.streaming and name == "pool")]

    def check_sources(self) -> None:
        """Every split and the subset file exist and every text split decodes, before any split is tokenized."""
        for name, path in self.paths.items():
            if self.pretokenized:
                if not Path(path).is_file():
                    raise DataSourceError(f"{name} token file {str(path)!r} does not exist")
            else:
                try:
                    check_source(path)
                except DataSourceError as e:
                    raise DataSourceError(f"{name} split: {e}") from None
        if self.subset_path and not Path(self.subset_path).is_file():
            raise SubsetError(f"subset file {str(self.subset_path)!r} does not exist (--data.subset)")

    def prepare_data(self) -> None:
        """Tokenize and cache every split once (local rank 0 only under DDP), after :meth:`check_sources`."""
        self.check_sources()
        for name in self._split_names():
            self._pack(name)
        if self.streaming:
            self._stream_count()
        subset = read_subset(self.subset_path) if self.subset_path else None
        if subset is not None and subset.kind == "doc_id":
            self._pack("pool", subset.ids)

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        self.check_sources()
        for name in self._split_names():
            self.splits[name] = self._pack(name)
        if self.streaming:
            return
        pool = self.splits["pool"]
        self._train_ids = np.arange(len(pool), dtype=np.int64)
        if self.subset_path:
            subset = read_subset(self.subset_path)
            if subset.kind == "doc_id":
                pool = self.splits["pool"] = self._pack("pool", subset.ids)
                order = {d: i for i, d in enumerate(pool.doc_ids.tolist())}
                self._train_ids = np.arange(len(pool), dtype=np.int64)
                if subset.weights is not None:
                    w = np.zeros(len(pool.doc_ids))
                    np.add.at(w, [order[d] for d in subset.ids], subset.weights)
                    self._train_weights = self._sample_weights_from_docs(pool, w)
            else:
                ids = np.asarray(subset.ids, dtype=np.int64)
                bad = ids[ids >= len(pool)]
                if bad.size:
                    raise SubsetError(
                        f"subset names sample_id(s) {bad[:5].tolist()} beyond the pool's {len(pool)} sequences "
                        f"(seq_len={self.seq_len}); make the subset with the same pool and seq_len"
                    )
                self._train_ids = ids
                self._train_weights = subset.weights

    @staticmethod
    def _sample_weights_from_docs(pool: PackedSplit, doc_weight: np.ndarray) -> np.ndarray:
        """Weight of a sample = weight of the document its first label token belongs to."""
        first = np.searchsorted(pool.doc_start, np.arange(len(pool)) * pool.seq_len + 1, side="right") - 1
        return doc_weight[first]

    def train_dataloader(self) -> SuperbatchLoader | StreamingSuperbatchLoader:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        if self.streaming:
            return StreamingSuperbatchLoader(
                self.paths["pool"], self.tokenizer, self.seq_len, self.superbatch_size, self.cache_dir, seed=self.seed,
                buffer_size=self.shuffle_buffer, columns=self.columns, rank=rank, world_size=world,
            )
        return SuperbatchLoader(
            self.splits["pool"],
            self._train_ids,
            self.superbatch_size,
            seed=self.seed,
            weights=self._train_weights,
            rank=rank,
            world_size=world,
            num_workers=self.num_workers,
        )

    def _eval_ids(self, name: str, cap: int | None) -> np.ndarray:
        n = len(self.splits[name])
        if cap is None or cap >= n:
            return np.arange(n, dtype=np.int64)
        return np.unique(np.linspace(0, n - 1, cap).round().astype(np.int64))

    def val_dataloader(self) -> DataLoader:
        ids = self._eval_ids("val", self.val_samples)
        return DataLoader(_SampleDataset(self.splits["val"], ids), batch_size=self.val_batch_size, shuffle=False)

    def target_batch(self, n: int, generator: np.random.Generator) -> dict[str, torch.Tensor]:
        """``n`` random target sequences (proxy batches, reference training, rewards)."""
        target = self.splits["target"]
        return target.batch(generator.choice(len(target), size=min(n, len(target)), replace=False))

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "seq_len": self.seq_len, "superbatch_size": self.superbatch_size,
                "tokenizer": self._tokenizer_id()}

    def _tokenizer_id(self) -> str:
        return self.tokenizer.fingerprint() if hasattr(self.tokenizer, "fingerprint") else "pretokenized"

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seq_len", "superbatch_size"):
            if state.get(key, getattr(self, key)) != getattr(self, key):
                raise ValueError(f"checkpoint was trained with data.{key}={state[key]}, this run has {getattr(self, key)}")
        if state.get("tokenizer", self._tokenizer_id()) != self._tokenizer_id():
            raise ValueError(
                f"checkpoint was trained with tokenizer {state['tokenizer']}, this run has {self._tokenizer_id()}; "
                "pass the checkpoint's data.tokenizer"
            )
