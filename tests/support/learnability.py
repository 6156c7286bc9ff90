"""Tiny, actually trained models with known learnability, shared by the ClassAct and RHO-LOSS tests.

Three kinds of pool sequences:
- ``learned``: lowercase word prose, the language of the target split. The reference (trained on
  the target) has learned it; the learner (trained on uppercase prose) has never seen lowercase.
- ``noise``: random printable bytes. Unlearnable: high loss under both.
- ``repeat``: one character repeated. Trivial, and in both models' training text: low under both.

Every document is 32·12 − 1 characters, so with its boundary token it fills whole 32-token
sequences and no pool sequence mixes two kinds.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

import train
from models.lit_gpt import LitGPT
from selection_callbacks.core.selection import SelectionRecord
from selection_callbacks.data.packing import pack_source
from selection_callbacks.nn.gpt import GPTConfig
from support.toy_corpus import WORDS
from tests.conftest import write_jsonl

SEQ_LEN = 32
DOC_CHARS = SEQ_LEN * 12 - 1
CFG = GPTConfig(vocab_size=320, block_size=SEQ_LEN, n_layer=2, n_head=2, n_embd=64)
KINDS = ("learned", "noise", "repeat")


def _text(kind: str, r: random.Random) -> str:
    if kind == "learned":
        text = " ".join(r.choice(WORDS) for _ in range(DOC_CHARS))
    elif kind == "upper":
        text = " ".join(r.choice(WORDS).upper() for _ in range(DOC_CHARS))
    elif kind == "noise":
        text = "".join(chr(r.randint(33, 126)) for _ in range(DOC_CHARS))
    else:
        text = "=" * DOC_CHARS
    return text[:DOC_CHARS]


def _docs(prefix: str, kinds: tuple[str, ...], per_kind: int, seed: int) -> list[dict]:
    r = random.Random(seed)
    return [{"id": f"{prefix}{kind}{i}", "text": _text(kind, r), "domain": kind}
            for i in range(per_kind) for kind in kinds]


def write_corpus(root: Path) -> dict[str, str]:
    """pool (learned/noise/repeat), target (learned + repeat), learner text (upper + repeat), val (learned)."""
    root.mkdir(parents=True, exist_ok=True)
    return {
        "pool": str(write_jsonl(root / "pool.jsonl", _docs("p", KINDS, 6, 0))),
        "target": str(write_jsonl(root / "target.jsonl", _docs("t", ("learned", "learned", "repeat"), 10, 1))),
        "learner": str(write_jsonl(root / "learner.jsonl", _docs("l", ("upper", "upper", "repeat"), 10, 2))),
        "val": str(write_jsonl(root / "val.jsonl", _docs("v", ("learned",), 4, 3))),
    }


def reference_command(corpus: dict[str, str], out: Path, steps: int = 150) -> list[str]:
    """The documented RHO reference command (``selection_callbacks.methods.rho.callback``), at test size."""
    target = corpus["target"]
    root = Path(train.__file__).parent
    return ["fit", "--config", str(root / "configs/scale/cpu-tiny.yaml"),
            "--config", str(root / "configs/method/random.yaml"),
            "--data.pool", target, "--data.target", target, "--data.val", target, "--data.ratio", "1",
            "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
            "--trainer.enable_checkpointing", "true", "--trainer.callbacks+=ModelCheckpoint",
            "--trainer.callbacks.dirpath", str(out), "--trainer.callbacks.filename", "reference",
            "--trainer.callbacks.save_on_train_epoch_end", "true",
            "--trainer.default_root_dir", str(out),
            # test size: a small model on 32-token sequences
            "--data.seq_len", str(SEQ_LEN), "--data.progress", "false", "--trainer.enable_progress_bar", "false",
            "--model.config.n_layer", str(CFG.n_layer), "--model.config.n_head", str(CFG.n_head),
            "--model.config.n_embd", str(CFG.n_embd), "--model.warmup_steps", "10"]


def train_reference(corpus: dict[str, str], out: Path) -> Path:
    """A reference checkpoint trained on the target split by the documented ``train.py`` command."""
    train.main(reference_command(corpus, out))
    ckpt = out / "reference.ckpt"
    assert ckpt.is_file(), f"the reference command wrote no {ckpt}"
    return ckpt


def trained_models(root: Path) -> dict:
    """The corpus, a reference checkpoint trained on its target split, and a learner trained on other text."""
    corpus = write_corpus(root / "data")
    return {"corpus": corpus, "ckpt": train_reference(corpus, root / "reference"),
            "learner": train_learner(corpus, root / "cache")}


def train_learner(corpus: dict[str, str], cache: Path, steps: int = 150) -> LitGPT:
    """A LitGPT trained (plain AdamW loop) on uppercase prose and repetition, never on lowercase."""
    torch.manual_seed(0)
    model = LitGPT(CFG)
    split = pack_source(corpus["learner"], SEQ_LEN, cache, name="learner", progress=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        loss = model.per_sample_loss(split.batch(rng.choice(len(split), 16, replace=False))).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def assert_learnability_order(record: SelectionRecord, domain_names: list[str], learner: torch.nn.Module,
                              reference: torch.nn.Module) -> None:
    """Losses and scores s = ℓ_learner − ℓ_ref of the three kinds land where the math says."""
    with torch.no_grad():
        learner_loss, reference_loss = learner.per_sample_loss(record.batch), reference.per_sample_loss(record.batch)
    kind = {name: record.domain == code for code, name in enumerate(domain_names)}
    assert all(int(kind[k].sum()) >= 5 for k in KINDS), "the superbatch should hold every kind"
    # noise: high under both; repeat: low under both; learned: low under the reference only
    assert learner_loss[kind["noise"]].min() > 3 and reference_loss[kind["noise"]].min() > 3
    assert learner_loss[kind["repeat"]].max() < 0.5 and reference_loss[kind["repeat"]].max() < 0.5
    assert reference_loss[kind["learned"]].max() < 1.5 and learner_loss[kind["learned"]].min() > 3
    s = record.scores
    torch.testing.assert_close(s, (learner_loss - reference_loss).float(), atol=1e-4, rtol=0)
    assert s[kind["learned"]].min() > max(s[kind["noise"]].max(), s[kind["repeat"]].max()) + 1
    assert s[kind["repeat"]].abs().max() < 0.5
    assert record.selected_mask[kind["learned"]].all(), "top-K keeps every learned candidate (fewer than K)"
