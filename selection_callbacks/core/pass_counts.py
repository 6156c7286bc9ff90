"""Counts of the forward and backward passes a selector runs beside training, per model: its cost model's input."""

from __future__ import annotations

from typing import Any


class CostMeter:
    """Forward/backward passes and tokens per model (``learner``, ``online``, ``reference``).

    A pass is one call on one batch; its tokens are ``input_ids.numel()``. Counts are this
    process's work: this micro-batch (reset by :meth:`new_step`) and cumulative.
    """

    KINDS = ("fwd", "bwd")

    def __init__(self) -> None:
        self.step: dict[str, list[int]] = {}
        self.total: dict[str, list[int]] = {}

    def add(self, model: str, kind: str, tokens: int) -> None:
        """Count one ``kind`` pass ("fwd"/"bwd") of ``model`` over ``tokens`` tokens."""
        for table in (self.step, self.total):
            entry = table.setdefault(f"{model}_{kind}", [0, 0])
            entry[0] += 1
            entry[1] += tokens

    def new_step(self) -> None:
        self.step = {}

    def metrics(self, kept_tokens: int) -> dict[str, float]:
        """``select/cost/<model>_<kind>[_tokens][_total]`` and, per kind, extra tokens over the kept tokens.

        ``select/cost/fwd_per_update`` = Σ forward tokens this micro-batch / K·T: the report's
        "3 fwd + 1 bwd" unit (passes over a batch the size of what the learner trains on).
        """
        out: dict[str, float] = {}
        for key, (passes, tokens) in self.total.items():
            out[f"select/cost/{key}_total"] = float(passes)
            out[f"select/cost/{key}_tokens_total"] = float(tokens)
            step_passes, step_tokens = self.step.get(key, (0, 0))
            out[f"select/cost/{key}"] = float(step_passes)
            out[f"select/cost/{key}_tokens"] = float(step_tokens)
        for kind in self.KINDS:
            tokens = sum(t for key, (_, t) in self.step.items() if key.endswith(kind))
            out[f"select/cost/{kind}_per_update"] = tokens / kept_tokens if kept_tokens else 0.0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {key: list(value) for key, value in self.total.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total = {key: [int(v) for v in value] for key, value in state.items()}
