"""The reference learner: ``lit_gpt`` (the GPT as a LightningModule with the per-sample loss
protocol and bits-per-byte validation) and ``reference`` (a ``train.py`` checkpoint as a frozen reference)."""

__all__ = ["lit_gpt", "reference"]
