"""The reference learner: the GPT as a LightningModule, and its checkpoints as frozen references."""
