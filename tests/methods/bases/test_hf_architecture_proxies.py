"""RHO-LOSS (whole sequences and 16-token windows) and ClassAct with a learner of each of the nine Hugging Face
families (``configs/model/tiny-*.yaml``), fitted in process: each selection is made, and every proxy is a smaller
model of the learner's own class whose attention heads are the proxy's width split among its heads."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing is downloaded

from models import LitCausalLM  # noqa: E402
from models.hf_causal_lm import causal_lm_config  # noqa: E402
from selection_callbacks.data.datamodule import PoolDataModule  # noqa: E402
from selection_callbacks.methods import ClassActSelection, RhoLossSelection  # noqa: E402
from selection_callbacks.scoring.proxy_models import CausalLMProxy  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt-neox", "olmo2", "phi3", "gemma2"]
SEQ_LEN, STEPS = 32, 2


def _selector(method: str):
    settings = {"ratio": 0.5, "reference_steps": 2, "reference_batch_size": 4, "proxy_width": 96, "proxy_heads": 3}
    if method == "classact":
        return ClassActSelection(**settings)
    return RhoLossSelection(**settings, score_len=16 if method == "rho_windows" else None)


def _head_dims(module: torch.nn.Module) -> set[int]:
    """The per-head sizes the attention modules of ``module`` compute with (``head_dim``, GPT-NeoX's ``head_size``)."""
    return {getattr(m, "head_dim", None) or m.head_size for m in module.modules()
            if type(m).__name__.endswith("Attention")}


@pytest.mark.parametrize("method", ["rho", "rho_windows", "classact"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_proxy_methods_select_with_proxies_of_the_learners_class(tiny_corpus, name: str, method: str) -> None:
    torch.manual_seed(0)
    learner = LitCausalLM(causal_lm_config(str(ROOT / f"configs/model/tiny-{name}.yaml")), warmup_steps=1)
    selector = _selector(method)
    trainer = L.Trainer(accelerator="cpu", max_steps=STEPS, callbacks=[selector], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    data = PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=SEQ_LEN, batch_size=4,
                          ratio=0.5, seed=0, progress=False)
    trainer.fit(learner, datamodule=data)
    assert trainer.global_step == STEPS and selector.selections == STEPS
    assert selector.summary()["kept"] == STEPS * 4 and torch.isfinite(selector.last_scores).all()
    assert set(selector.proxies) == ({"online"} if method == "classact" else set())
    reference = selector.reference.proxy
    assert selector.reference.kind == "built" and reference.frozen and reference.steps == 2
    for proxy in [reference, *selector.proxies.values()]:
        module = proxy.module
        assert isinstance(module, CausalLMProxy) and type(module.model) is type(learner.model)
        config = module.config
        assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 96, 3)
        assert config.vocab_size == learner.config.vocab_size
        assert _head_dims(module.model) == {96 // 3} and _head_dims(learner.model) == {64 // 4}
    if method == "classact":
        assert selector.proxies["online"].steps == STEPS  # the actor trained on each step's selected rows
