"""Hugging Face causal LMs as the learner: per-sample loss against brute force, the Muon/AdamW split rule
on Llama, GPT-2 (Conv1D) and Qwen2, short train.py runs per model, method and optimizer, config errors."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing is downloaded

import train  # noqa: E402
from models import LitCausalLM  # noqa: E402
from models.hf_causal_lm import causal_lm_config  # noqa: E402
from models.lit_gpt import LitGPT  # noqa: E402
from selection_callbacks.data.datamodule import PoolDataModule  # noqa: E402
from selection_callbacks.methods import RandomSelection  # noqa: E402
from selection_callbacks.nn.optim import build_optimizer, param_split  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODELS = ["llama", "gpt2", "qwen2"]


def _model(name: str, **overrides) -> LitCausalLM:
    torch.manual_seed(0)
    config = causal_lm_config(str(ROOT / f"configs/model/tiny-{name}.yaml"))
    for key, value in overrides.items():
        setattr(config, key, value)
    return LitCausalLM(config).eval()


def _batch(n: int = 4, t: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (n, t + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


@pytest.mark.parametrize("name", MODELS)
def test_per_sample_loss_is_each_rows_mean_over_its_label_tokens(name: str) -> None:
    model = _model(name)
    batch = _batch()
    mask = (torch.rand(4, 16, generator=torch.Generator().manual_seed(1)) > 0.4).float()
    with torch.no_grad():
        per = model.per_sample_loss(batch)
        masked = model.per_sample_loss({**batch, "loss_mask": mask})
        shifted = model.per_sample_loss({"input_ids": batch["input_ids"]})
        for i in range(4):  # brute force: one row at a time through the bare transformers model
            logits = model.model(input_ids=batch["input_ids"][i : i + 1]).logits[0]
            nll = F.cross_entropy(logits, batch["labels"][i], reduction="none")
            torch.testing.assert_close(per[i], nll.mean(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(masked[i], nll[mask[i] > 0].mean(), rtol=1e-5, atol=1e-5)
            ids = batch["input_ids"][i]
            torch.testing.assert_close(shifted[i], F.cross_entropy(logits[:-1], ids[1:]), rtol=1e-5, atol=1e-5)


def test_validation_loss_and_bits_per_byte() -> None:
    model = _model("qwen2")
    batch = _batch()
    batch["labels"][:, 0] = 256  # a document boundary: predicted, but no bytes
    with torch.no_grad():
        model.validation_step(batch, 0)
        nll = F.cross_entropy(model(batch["input_ids"]).transpose(1, 2), batch["labels"], reduction="none")
    torch.testing.assert_close(model.val_nats.compute() / model.val_tokens.compute(), nll.mean())
    bpb = model.val_byte_nats.compute() / (math.log(2) * model.val_bytes.compute())
    torch.testing.assert_close(bpb, nll[:, 1:].sum() / (math.log(2) * 4 * 15))


@pytest.mark.parametrize("name, tied", [("llama", True), ("llama", False), ("qwen2", False), ("qwen2", True)])
def test_split_rule_on_llama_and_qwen2(name: str, tied: bool) -> None:
    model = _model(name, tie_word_embeddings=tied).model
    split = param_split(model)
    layers = model.config.num_hidden_layers
    matrices = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj"}
    assert set(split.hidden) == {f"model.layers.{i}.{m}.weight" for i in range(layers) for m in matrices}
    head = set() if tied else {"lm_head.weight"}
    assert set(split.other2d) == {"model.embed_tokens.weight"} | head
    assert split.tied == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    assert all(p.ndim == 1 for p in split.flat.values()) and not split.transposed
    biases = {n for n in split.flat if n.endswith(".bias")}
    assert biases == ({f"model.layers.{i}.self_attn.{m}_proj.bias" for i in range(layers) for m in "qkv"}
                      if name == "qwen2" else set())
    counted = sum(p.numel() for part in (split.hidden, split.other2d, split.flat) for p in part.values())
    assert counted == sum(p.numel() for p in model.parameters())  # parameters() lists a tied tensor once


def test_split_rule_on_gpt2_conv1d() -> None:
    model = _model("gpt2").model
    split = param_split(model)
    conv = {f"transformer.h.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                         "mlp.c_proj")}
    assert set(split.hidden) == conv and split.transposed == conv
    assert set(split.other2d) == {"transformer.wte.weight", "transformer.wpe.weight"}  # position table too
    assert split.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert {n.rsplit(".", 2)[-2] for n in split.flat} == {"ln_1", "ln_2", "ln_f", "c_attn", "c_proj", "c_fc"}
    table = split.describe("muon")
    assert "lm_head.weight is transformer.wte.weight" in table and "transformer.h.*.mlp.c_fc.weight" in table
    assert len(table.splitlines()) == 6  # a compact table, not a line per tensor


def test_muon_steps_a_conv1d_weight_as_the_transposed_linear() -> None:
    """Orthogonalisation commutes with the transpose; the group lr corrects torch's shape-based step size."""
    gpt2 = _model("gpt2").model
    opt = build_optimizer(gpt2, "muon", 3e-3, 0.1, (0.9, 0.95), 0.02, 0.95, 0.01)
    conv = gpt2.transformer.h[0].mlp.c_fc  # weight [in=64, out=256]
    linear = torch.nn.Linear(64, 256, bias=False)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.T)
    reference = torch.optim.Muon([linear.weight], lr=0.02, momentum=0.95, weight_decay=0.01)
    for step in range(2):
        grad = torch.randn(256, 64, generator=torch.Generator().manual_seed(step))
        for p in gpt2.parameters():
            p.grad = torch.zeros_like(p)
        conv.weight.grad, linear.weight.grad = grad.T.clone(), grad.clone()
        opt.step()
        reference.step()
        torch.testing.assert_close(conv.weight.T, linear.weight, rtol=1e-5, atol=1e-6)
    group = next(g for g in opt.muon.param_groups if any(p is conv.weight for p in g["params"]))
    assert group["lr"] == pytest.approx(0.02 * 2) and group["weight_decay"] == pytest.approx(0.01 / 2)


def _run(corpus: dict[str, str], root: Path, name: str, method: str, optimizer: str, *extra: str) -> dict:
    """A 3-step train.py run of ``configs/model/tiny-{name}.yaml`` (or ``name`` as an inline config)."""
    config = str(ROOT / f"configs/model/tiny-{name}.yaml") if name in MODELS else name
    args = ["fit", "--config", str(ROOT / "configs/scale/cpu-tiny.yaml"), "--config",
            str(ROOT / f"configs/method/{method}.yaml"), "--model", "models.LitCausalLM",
            "--model.config", config, "--model.optimizer", optimizer,
            "--model.warmup_steps", "1", "--data.pool", corpus["pool"], "--data.target", corpus["target"],
            "--data.val", corpus["val"], "--data.seq_len", "32", "--data.batch_size", "4", "--data.val_samples", "8",
            "--data.progress", "false", "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
            "--trainer.enable_progress_bar", "false", "--trainer.logger", "false", "--ledger.enabled", "false",
            "--trainer.default_root_dir", str(root), *extra]
    cli = train.main(args)
    assert isinstance(cli.model, LitCausalLM)
    return json.loads((root / "metrics.json").read_text())


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("method, optimizer", [("random", "adamw"), ("random", "muon"), ("high_loss", "adamw"),
                                               ("high_loss", "muon"), ("oracle", "adamw"), ("opus_greedy", "muon"),
                                               ("rho", "adamw"), ("classact", "muon"), ("classact_report", "adamw")])
def test_train_py_runs_each_model(tiny_corpus, tmp_path: Path, name: str, method: str, optimizer: str) -> None:
    metrics = _run(tiny_corpus, tmp_path, name, method, optimizer)
    built = yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]["init_args"]
    assert built["config"]["model_type"] == name and built["optimizer"] == optimizer  # the file's fields, inline
    assert metrics["global_step"] == 3 and metrics["update_tokens"] == 3 * 4 * 32  # K=4 of N=8
    assert metrics["selection"]["kept"] == 3 * 4 and metrics["selection"]["candidates_seen"] == 3 * 8
    assert 0 < metrics["val_bpb"] < 20


def test_inline_config_of_an_untied_llama(tiny_corpus, tmp_path: Path) -> None:
    inline = ("{model_type: llama, vocab_size: 320, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
              "num_attention_heads: 2, max_position_embeddings: 64, tie_word_embeddings: false}")
    metrics = _run(tiny_corpus, tmp_path, inline, "high_loss", "muon")
    assert metrics["global_step"] == 3 and 0 < metrics["val_bpb"] < 20
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]
    assert saved["class_path"] == "models.LitCausalLM"
    assert saved["init_args"]["config"]["tie_word_embeddings"] is False


def test_the_default_learner_stays_the_gpt_sized_by_the_data(tiny_corpus) -> None:
    args = ["--config", str(ROOT / "configs/scale/cpu-tiny.yaml"), "--model.config.n_layer", "1", "--data.seq_len", "48",
            "--data.pool", tiny_corpus["pool"], "--data.target", tiny_corpus["target"], "--data.val", tiny_corpus["val"]]
    cli = train.SelectionCLI(None, PoolDataModule, subclass_mode_model=True, args=args, run=False)
    assert isinstance(cli.model, LitGPT) and (cli.model.config.n_layer, cli.model.config.block_size) == (1, 48)


def test_a_config_file_with_one_field_changed_on_the_command_line(tiny_corpus) -> None:
    args = ["--config", str(ROOT / "configs/scale/cpu-tiny.yaml"), "--model", "models.LitCausalLM",
            "--model.config", str(ROOT / "configs/model/tiny-llama.yaml"), "--model.config.num_hidden_layers", "1",
            "--data.pool", tiny_corpus["pool"], "--data.target", tiny_corpus["target"], "--data.val", tiny_corpus["val"]]
    cli = train.SelectionCLI(None, PoolDataModule, subclass_mode_model=True, args=args, run=False)
    assert (cli.model.config.num_hidden_layers, cli.model.config.hidden_size) == (1, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", MODELS)
def test_bf16_run_on_cuda(tiny_corpus, tmp_path: Path, name: str) -> None:
    metrics = _run(tiny_corpus, tmp_path, name, "high_loss", "muon", "--trainer.accelerator", "gpu",
                   "--trainer.precision", "bf16-mixed")
    assert metrics["global_step"] == 3 and 0 < metrics["val_bpb"] < 20


def test_start_up_lists_the_split(tiny_corpus, tmp_path: Path, caplog) -> None:
    with caplog.at_level("INFO", logger="lightning.pytorch"):
        _run(tiny_corpus, tmp_path, "gpt2", "random", "muon")
    assert "LitCausalLM: parameter split for optimizer='muon'" in caplog.text
    assert "stored [in, out] (Conv1D" in caplog.text


def test_a_checkpoint_rebuilds_the_model_without_its_config_file(tiny_corpus, tmp_path: Path) -> None:
    dm = PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=32, batch_size=4,
                        ratio=0.5, progress=False)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, callbacks=[RandomSelection(0.5)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    model = LitCausalLM(str(ROOT / "configs/model/tiny-qwen2.yaml"), optimizer="muon", warmup_steps=1)
    trainer.fit(model, datamodule=dm)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    loaded = LitCausalLM.load_from_checkpoint(tmp_path / "last.ckpt", map_location="cpu")
    assert loaded.hparams.optimizer == "muon" and loaded.config.to_diff_dict() == model.config.to_diff_dict()
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("config, error, match", [
    ("missing.yaml", FileNotFoundError, r"config file 'missing.yaml' does not exist"),
    ({"hidden_size": 64}, ValueError, r"has no model_type: name the architecture"),
    ({"model_type": "no-such-model"}, ValueError, r"model_type 'no-such-model' is not a transformers architecture"),
    ({"model_type": "vit"}, ValueError, r"'vit' \(ViTConfig\) has no causal-LM class"),
    ([1, 2], TypeError, r"the config is a list; expected a mapping"),
])
def test_unsupported_configs_are_named(config, error, match) -> None:
    with pytest.raises(error, match=match):
        LitCausalLM(config)


def test_causal_lm_without_its_config_is_named(tiny_corpus, capsys) -> None:
    """The scale config's GPT fields do not carry over to LitCausalLM: jsonargparse asks for the config."""
    args = ["--config", str(ROOT / "configs/scale/cpu-tiny.yaml"), "--model", "models.LitCausalLM",
            "--data.pool", tiny_corpus["pool"], "--data.target", tiny_corpus["target"], "--data.val", tiny_corpus["val"]]
    with pytest.raises(SystemExit):
        train.SelectionCLI(None, PoolDataModule, subclass_mode_model=True, args=args, run=False)
    assert "LitCausalLM':\n        the following arguments are required: config" in capsys.readouterr().err


def test_sequences_longer_than_the_position_table(tiny_corpus) -> None:
    dm = PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=32, batch_size=4,
                        ratio=0.5, progress=False)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, callbacks=[RandomSelection(0.5)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"data.seq_len=32 exceeds model.config.max_position_embeddings=16"):
        trainer.fit(_model("gpt2", n_positions=16), datamodule=dm)
