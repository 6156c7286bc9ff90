"""What one scoring pass holds: the captures of its layers, what the target rows fix, and the accumulators."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selection_callbacks.scoring.maps.base import OptimizerMap, StepMaps


@dataclass
class FixedMaps:
    """What the target rows fix for a group of L layers: the map P, the utility vector
    Q = −Jᵀḡ [L, ...], the bias terms, AdamW's factor errors [L] and whether its sketch goes through the factors."""

    map: OptimizerMap
    Q: torch.Tensor
    bias_map: OptimizerMap | None = None
    Q_bias: torch.Tensor | None = None
    factor_error: torch.Tensor | None = None
    relative_factor_error: torch.Tensor | None = None
    factored: bool = True


class PassState:
    """Captures and accumulators of one forward/backward over n candidate rows then p target rows
    (either may be 0); the passes of one scoring call hold one ``fixed``.

    The capture fills ``inputs`` (a layer's input, detached), ``out_shapes``, ``grads`` (a layer's output
    gradient) and ``shared`` (layers whose output has no row dimension); the engine fills ``group_of`` and the
    scorers the accumulators (``utilities``, ``sketch``, ``sq_norms``, ``probe_gram``).
    """

    def __init__(self, n: int, p: int, step_maps: StepMaps, seed: int, fixed: dict[tuple[str, ...], FixedMaps]) -> None:
        self.n, self.p, self.step_maps, self.seed, self.fixed = n, p, step_maps, seed, fixed
        self.shared: list[str] = []
        self.inputs: dict[str, torch.Tensor] = {}
        self.out_shapes: dict[str, torch.Size] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.group_of: dict[str, tuple[str, ...]] = {}
        self.utilities: dict[str, torch.Tensor] = {}
        self.losses: torch.Tensor | None = None
        self.sketch: torch.Tensor | None = None
        self.sq_norms: torch.Tensor | None = None
        self.probe = 0  # candidates whose exact Gram this pass accumulates
        self.probe_gram: torch.Tensor | None = None
        self.factor_errors = True  # whether the pass that fixes the maps reports AdamW's Frobenius factor errors

    def target_rows(self) -> int:
        """P of this pass; a layer's map is fixed in the pass that carries the target rows."""
        if not self.p:
            raise RuntimeError("ghost scoring: a candidate pass ran before the target rows fixed the layer's map")
        return self.p

    def add_sketch(self, s: torch.Tensor) -> None:
        self.sketch = s if self.sketch is None else self.sketch + s

    def add_norm(self, v: torch.Tensor) -> None:
        self.sq_norms = v if self.sq_norms is None else self.sq_norms + v

    def add_probe(self, *pg: torch.Tensor) -> None:
        """Adds Σ ⟨P G_i, P G_j⟩ of the probed candidates' exact P G_i, each [L, k, ...]."""
        for x in pg:
            flat = x.float().transpose(0, 1).flatten(1)
            gram = flat @ flat.T
            self.probe_gram = gram if self.probe_gram is None else self.probe_gram + gram
