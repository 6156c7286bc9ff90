"""Proxies of the user's architecture: with a Hugging Face learner, RHO-LOSS's reference and ClassAct's actor and
reference are that architecture at proxy_layers × proxy_width with the learner's vocabulary, seeded like the GPT
proxies; with neither a learner config nor the datamodule's sizes, one error names every way to give them."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing is downloaded

from bench.harness import cost_model  # noqa: E402
from models import LitCausalLM  # noqa: E402
from models.hf_causal_lm import causal_lm_config  # noqa: E402
from models.lit_gpt import LitGPT  # noqa: E402
from selection_callbacks.data.datamodule import PoolDataModule  # noqa: E402
from selection_callbacks.methods import ClassActSelection, RhoLossSelection  # noqa: E402
from selection_callbacks.nn.gpt import GPTConfig  # noqa: E402
from selection_callbacks.scoring.proxy_models import (  # noqa: E402
    CausalLMProxy,
    ProxyLM,
    causal_lm_proxy_config,
    seeded_proxy,
)

ROOT = Path(__file__).resolve().parents[3]
SEQ_LEN = 32


def _llama() -> LitCausalLM:
    torch.manual_seed(0)
    return LitCausalLM(causal_lm_config(str(ROOT / "configs/model/tiny-llama.yaml")), warmup_steps=1)


def _fit(corpus: dict[str, str], selector, learner: L.LightningModule, steps: int = 2) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, callbacks=[selector], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    dm = PoolDataModule(corpus["pool"], corpus["target"], corpus["val"], seq_len=SEQ_LEN, batch_size=4, ratio=0.5,
                        seed=0, progress=False)
    trainer.fit(learner, datamodule=dm)
    return trainer


def _assert_small_llama(module: torch.nn.Module, selector, learner: LitCausalLM) -> None:
    assert isinstance(module, CausalLMProxy) and type(module.model).__name__ == "LlamaForCausalLM"
    config = module.config
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size) == (selector.proxy_layers, selector.proxy_width) == (2, 128)
    assert config.num_attention_heads == selector.proxy_heads
    assert config.vocab_size == learner.config.vocab_size
    assert config.intermediate_size == 2 * learner.config.intermediate_size  # the MLP keeps its ratio to the width
    assert config.num_key_value_heads == 2 and config.head_dim == 128 // 4  # grouped-query attention kept


def test_rho_loss_pretrains_a_smaller_llama_of_the_llama_learner(tiny_corpus) -> None:
    learner = _llama()
    selector = RhoLossSelection(ratio=0.5, reference_steps=3, reference_batch_size=4)
    trainer = _fit(tiny_corpus, selector, learner)
    reference = selector.reference.proxy
    _assert_small_llama(reference.module, selector, learner)
    assert reference.frozen and reference.steps == 3 and selector.selections == 2
    assert selector.summary()["cost"]["reference_pretrain_bwd"] == {"passes": 3, "tokens": 3 * 4 * SEQ_LEN}
    first, again = (selector.build_proxy(trainer, learner, "reference") for _ in range(2))  # seeded by (seed, purpose)
    other = selector.build_proxy(trainer, learner, "online")
    for key, value in first.state_dict().items():
        torch.testing.assert_close(again.state_dict()[key], value, rtol=0, atol=0)
    assert not torch.equal(other.model.model.embed_tokens.weight, first.model.model.embed_tokens.weight)


def test_classact_actor_and_reference_are_smaller_llamas(tiny_corpus) -> None:
    learner = _llama()
    selector = ClassActSelection(ratio=0.5, reference_steps=2, reference_batch_size=4)
    _fit(tiny_corpus, selector, learner)
    assert selector.online == "proxy" and set(selector.proxies) == {"online"}
    for proxy in (selector.proxies["online"], selector.reference.proxy):
        _assert_small_llama(proxy.module, selector, learner)
    assert selector.proxies["online"].steps == 2  # the actor trained on each step's selected rows


@pytest.mark.parametrize("name", ["gpt2", "qwen2"])
def test_proxy_config_of_other_architectures(name: str) -> None:
    learner = causal_lm_config(str(ROOT / f"configs/model/tiny-{name}.yaml"))
    config = causal_lm_proxy_config(learner, layers=3, width=96, heads=3)
    assert type(config) is type(learner) and config.vocab_size == learner.vocab_size
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (3, 96, 3)
    assert (learner.num_hidden_layers, learner.hidden_size) == (2, 64)  # the learner's config is not modified
    proxy = seeded_proxy(config, 0, "reference")
    assert proxy.model.config.num_hidden_layers == 3
    losses = proxy.per_sample_loss({"input_ids": torch.randint(0, 256, (5, 16))})
    assert losses.shape == (5,) and torch.isfinite(losses).all()
    with pytest.raises(ValueError, match="proxy_width=100 must be a multiple of proxy_heads=3"):
        causal_lm_proxy_config(learner, layers=1, width=100, heads=3)


def test_gpt_learner_keeps_the_plugins_gpt_proxy(tiny_corpus) -> None:
    learner_config = GPTConfig(vocab_size=320, block_size=SEQ_LEN, n_layer=1, n_head=2, n_embd=32)
    selector = RhoLossSelection(ratio=0.5, reference_steps=1, reference_batch_size=4)
    trainer = _fit(tiny_corpus, selector, LitGPT(learner_config, warmup_steps=1), steps=1)
    config = selector.proxy_config(trainer, trainer.lightning_module)
    assert config == GPTConfig(vocab_size=320, block_size=SEQ_LEN, n_layer=2, n_head=4, n_embd=128)
    settings = {"proxy_layers": 2, "proxy_width": 128, "proxy_heads": 4}  # RHO-LOSS's defaults
    assert cost_model.proxy_config(learner_config, settings) == config  # the benchmark's cost model counts these proxies
    built, seeded = selector.build_proxy(trainer, trainer.lightning_module, "reference"), seeded_proxy(config, 0, "reference")
    assert isinstance(built, ProxyLM) and isinstance(selector.reference.proxy.module, ProxyLM)
    for key, value in seeded.state_dict().items():
        torch.testing.assert_close(built.state_dict()[key], value, rtol=0, atol=0)


def test_without_a_learner_config_or_datamodule_sizes_the_error_names_all_three() -> None:
    selector = RhoLossSelection(ratio=0.5)
    trainer = SimpleNamespace(datamodule=SimpleNamespace())  # no vocab_size, no seq_len
    with pytest.raises(ValueError) as info:
        selector.proxy_config(trainer, L.LightningModule())
    message = str(info.value)
    for way in ("PretrainedConfig", "GPTConfig", "vocab_size and seq_len", "override build_proxy"):
        assert way in message, f"{way!r} missing from: {message}"
