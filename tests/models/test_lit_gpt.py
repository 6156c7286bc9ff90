"""The GPT LightningModule: per-sample loss protocol, loss mask, bits-per-byte."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models.lit_gpt import LitGPT
from selection_callbacks.nn.gpt import GPTConfig

CFG = GPTConfig(vocab_size=320, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _batch(n: int = 6, t: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n, t + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "sample_id": torch.arange(n)}


def test_per_sample_loss_matches_batched_and_single_row() -> None:
    torch.manual_seed(0)
    model = LitGPT(CFG).eval()
    batch = _batch()
    with torch.no_grad():
        per = model.per_sample_loss(batch)
        logits = model(batch["input_ids"])
        batched = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        singles = torch.stack(
            [model.per_sample_loss({k: v[i : i + 1] for k, v in batch.items()})[0] for i in range(6)]
        )
    assert per.shape == (6,)
    torch.testing.assert_close(per.mean(), batched, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(per, singles, rtol=1e-5, atol=1e-5)


def test_loss_mask_excludes_tokens() -> None:
    torch.manual_seed(0)
    model = LitGPT(CFG).eval()
    batch = _batch(n=2)
    mask = torch.zeros(2, 16)
    mask[:, :5] = 1
    with torch.no_grad():
        nll = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(), reduction="none")
        masked = model.per_sample_loss({**batch, "loss_mask": mask})
    torch.testing.assert_close(masked, nll.view(2, 16)[:, :5].mean(1))


def test_shifted_input_ids_without_labels() -> None:
    torch.manual_seed(0)
    model = LitGPT(CFG).eval()
    batch = _batch(n=3)
    full = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], 1)[:, :16]
    with torch.no_grad():
        nll = F.cross_entropy(model(full)[:, :-1].flatten(0, 1), full[:, 1:].flatten())
        assert torch.allclose(model.per_sample_loss({"input_ids": full}).mean(), nll, atol=1e-6)


def test_validation_bpb_excludes_boundary_tokens() -> None:
    torch.manual_seed(0)
    model = LitGPT(CFG).eval()
    batch = _batch(n=4)
    batch["labels"][:, 0] = 256  # a document boundary: predicted, but no bytes
    with torch.no_grad():
        model.validation_step(batch, 0)
        nll = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(), reduction="none")
    nll = nll.view(4, 16)
    expected_bpb = nll[:, 1:].sum() / (math.log(2) * 4 * 15)
    assert torch.allclose(model.val_byte_nats.compute() / (math.log(2) * model.val_bytes.compute()), expected_bpb)
    assert torch.allclose(model.val_nats.compute() / model.val_tokens.compute(), nll.mean())


def test_bad_model_config() -> None:
    import pytest

    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)


@pytest.mark.parametrize("stack", [{"compile": True}, {"activation_checkpointing": True}])
def test_a_learner_that_names_no_blocks_is_refused_the_stack(stack: dict) -> None:
    from models.language_model import LitLanguageModel

    class Unnamed(LitLanguageModel):
        def __init__(self) -> None:
            super().__init__(vocab_size=320, **stack)
            self.model = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="does not name its transformer blocks: implement transformer_blocks"):
        Unnamed().configure_model()
