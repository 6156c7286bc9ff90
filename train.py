"""Train a GPT, or any Hugging Face causal LM, on a pool with an online selection callback.

    python train.py fit --config configs/scale/cpu-tiny.yaml --config configs/method/random.yaml \
        --data.pool P --data.target T --data.val V

The learner is ``--model``: this project's GPT (``LitGPT``, the default; ``--model.config.n_layer``
and the other ``GPTConfig`` fields size it) or a transformers causal LM built from its config,
``--model models.LitCausalLM --model.config configs/model/tiny-llama.yaml``
(a config file, one field changed with ``--model.config.num_hidden_layers 4``, or inline fields:
``--model.config '{model_type: llama, hidden_size: 64, ...}'``).
The optimizer arguments (``--model.optimizer muon``, ``--model.lr``, ...) are the same for both.

The selection callback is ``--selection`` (a ``SelectionCallback`` subclass; its ratio follows
``--data.ratio``); ``--recorder`` writes ``metrics.json`` (validation curve against update
tokens and wall-clock) to the run folder. After ``fit`` a final validation prints ``val_bpb``.

The run folder is ``--recorder.out_dir`` (default ``--trainer.default_root_dir``); it holds the
resolved ``config.yaml`` of its run. ``--recorder.progress_every S`` prints a progress line
(step, update tokens, tokens/s, selection share, last val bpb) every S seconds. ``--ledger``
records every candidate's score and fate under ``<run folder>/ledger/`` (on by default,
``--ledger.enabled false`` turns it off; ``python -m selection_callbacks.cli.ledger`` exports and
summarises it). ``--dashboard`` logs throughput scalars to every logger and, with W&B, score
histograms and domain tables (``--dashboard.histogram_every``).

The training stack (docs/stack.md): ``--model.compile true`` (inductor, per transformer block),
``--model.activation_checkpointing true``, ``--trainer.precision bf16-mixed``, and FSDP2 with
``--trainer.strategy lightning.pytorch.strategies.ModelParallelStrategy --trainer.strategy.data_parallel_size D
--trainer.strategy.tensor_parallel_size 1 --trainer.devices D`` (gloo on CPU, NCCL on GPUs). A selection
method that does not serve the stack refuses it before the first step.

Loggers: the scale configs set none, so Lightning's default applies (TensorBoard when installed,
else CSV, under the run folder). ``--config configs/logger/wandb.yaml`` logs to W&B offline
(``runs/wandb/offline-run-*``; upload later with ``wandb sync``).

``--ckpt_path`` resumes a run; the checkpoint loads with ``weights_only=True`` (tensors and plain
containers, no code), and is refused while ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

import selection_callbacks.methods  # noqa: F401  (registers the methods, so --selection RandomSelection resolves)
from models.lit_gpt import LitGPT
from selection_callbacks.callbacks.base import SelectionCallback
from selection_callbacks.callbacks.dashboard import SelectionDashboard
from selection_callbacks.callbacks.ledger_writer import SelectionLedger
from selection_callbacks.callbacks.recorder import RunRecorder
from selection_callbacks.core.safe_load import refuse_forced_pickle
from selection_callbacks.data.datamodule import PoolDataModule


class RunFolderConfig(SaveConfigCallback):
    """Writes the resolved ``config.yaml`` into the run folder (``--recorder.out_dir``, default
    ``--trainer.default_root_dir``), whatever folder the logger writes to, so each run keeps its own."""

    def save_config(self, trainer, pl_module, stage: str) -> None:
        recorder = next((c for c in trainer.callbacks if isinstance(c, RunRecorder)), None)
        folder = Path((recorder.out_dir if recorder else None) or trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.parser.save(self.config, str(folder / self.config_filename), skip_none=False, overwrite=True,
                         multifile=self.multifile)


class SelectionCLI(LightningCLI):
    """LightningCLI with a selection callback, run recorder, ledger and dashboard as first-class arguments."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(SelectionCallback, "selection", subclass_mode=True, required=False)
        parser.add_lightning_class_args(RunRecorder, "recorder")
        parser.add_lightning_class_args(SelectionLedger, "ledger")
        parser.add_lightning_class_args(SelectionDashboard, "dashboard")
        parser.link_arguments("recorder.out_dir", "ledger.run_dir")
        parser.link_arguments("data.ratio", "selection.init_args.ratio")
        parser.link_arguments("data.seed", "selection.init_args.seed")
        if self.subclass_mode_model:  # --model names the learner: LitGPT unless told otherwise
            parser.set_defaults({"model": {"class_path": f"{LitGPT.__module__}.{LitGPT.__name__}"}})
        else:  # the learner is fixed: the GPT's block size follows the data
            parser.link_arguments("data.seq_len", "model.config.block_size")

    def before_instantiate_classes(self) -> None:
        """With ``--model`` free, a learner whose config has a ``block_size`` (the GPT's) gets ``data.seq_len``."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        learner_config = config.model.init_args.get("config") if self.subclass_mode_model else None
        if isinstance(learner_config, Namespace) and "block_size" in learner_config:
            learner_config.block_size = config.data.seq_len

    def _instantiate_trainer(self, config, callbacks):
        # an absent --selection is None among the extra callbacks: leave it out
        return super()._instantiate_trainer(config, [c for c in callbacks if c is not None])

    def parse_arguments(self, parser, args) -> None:
        """Parse ``args``; a resume from ``--ckpt_path`` loads with ``weights_only=True`` only, and is refused
        while ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set (before LightningCLI reads the checkpoint's hparams)."""
        super().parse_arguments(parser, args)
        config = self.config.get(self.config.get("subcommand") or "", None)
        if config is not None and config.get("ckpt_path") is not None:
            refuse_forced_pickle(config.ckpt_path, "the resume checkpoint (--ckpt_path)")
            if "weights_only" in config:
                config.weights_only = True

    def before_fit(self) -> None:
        has_selector = any(isinstance(c, SelectionCallback) for c in self.trainer.callbacks)
        if not has_selector and self.datamodule.ratio < 1.0:
            raise ValueError(
                f"data.ratio={self.datamodule.ratio} builds superbatches of {self.datamodule.superbatch_size} but no "
                "--selection callback keeps K of them: add --config configs/method/<name>.yaml or set --data.ratio 1"
            )

    def after_fit(self) -> None:
        recorder = next(c for c in self.trainer.callbacks if isinstance(c, RunRecorder))
        if not recorder.curve or recorder.curve[-1][0] != recorder.update_tokens:
            self.trainer.validate(self.model, datamodule=self.datamodule, verbose=False)
        if self.trainer.is_global_zero and recorder.summary.get("val_bpb") is not None:
            print(f"val_bpb={recorder.summary['val_bpb']:.4f}")


def main(args: list[str] | None = None) -> SelectionCLI:
    return SelectionCLI(L.LightningModule, PoolDataModule, subclass_mode_model=True, args=args,
                        save_config_callback=RunFolderConfig,
                        save_config_kwargs={"overwrite": True, "save_to_log_dir": False})


if __name__ == "__main__":
    main()
