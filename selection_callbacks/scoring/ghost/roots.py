"""The roots of a scoring backward: the captured tensors ``torch.autograd.grad`` differentiates the loss to.

A scored layer's output gradient exists only if the backward runs through the layer, that is if a root is its
input or among its input's ancestors in the autograd graph. The backward stops at the roots, so every layer
before them costs no backward, and autograd keeps each root's gradient until the backward ends, so there are
as few as the wiring allows: a scored layer's input becomes a root only when no earlier root reaches it.

- A stack of sequential blocks has one root, the first scored layer's input: every later layer is computed
  from it.
- A parallel-residual block (GPT-NeoX, Pythia, GPT-J: x + attn(ln₁(x)) + mlp(ln₂(x))) feeds its MLP from the
  block's input, not from the attention's output: the first scored block's MLP input is a second root (the
  later blocks' inputs already sum that block's attention output).
- A layer fed by token ids (an embedding) or by a tensor that needs no gradient starts a branch: its output
  is a root.

Whether a root reaches a tensor is decided at node granularity by a walk of the autograd graph from the
tensor's node towards the inputs (``Node.next_functions``), each node classified once per forward, so all the
walks of one forward visit each node at most once; a root is one output of its node, so a sibling output of a
multi-output node (a split) is not taken for a root.
"""

from __future__ import annotations

import torch

Edge = tuple[object, int]  # an autograd node and one of its outputs: where a tensor sits in the backward graph


class Roots:
    """The roots of one forward, and which autograd nodes they reach.

    Example::

        roots = Roots()
        roots.add(h)                 # the first scored layer's input
        roots.reaches(h + attn(h))   # True: computed from h
        roots.reaches(other)         # False: a parallel branch; roots.add(other) makes it one
    """

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._edges: set[Edge] = set()  # (node, output) of each non-leaf root
        self._leaves: set[int] = set()  # ids of leaf roots (a node reaches one through its AccumulateGrad)
        self._reached: dict[object, bool] = {}  # node → whether a root is among its inputs' ancestors

    def add(self, tensor: torch.Tensor) -> None:
        """``tensor`` becomes a root: the backward runs down to it."""
        self.tensors.append(tensor)
        if tensor.grad_fn is None:
            self._leaves.add(id(tensor))
        else:
            self._edges.add((tensor.grad_fn, tensor.output_nr))
        self._reached = {node: True for node, hit in self._reached.items() if hit}  # a node that missed may reach it now

    def reaches(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a root or computed from one (a backward to the roots then runs through it)."""
        if tensor.grad_fn is None:
            return id(tensor) in self._leaves
        if (tensor.grad_fn, tensor.output_nr) in self._edges:
            return True
        stack = [tensor.grad_fn]
        while stack:
            node = stack[-1]
            if node in self._reached:
                stack.pop()
                continue
            parents = [edge for edge in node.next_functions if edge[0] is not None]
            unknown = [parent for parent, _ in parents if parent not in self._reached]
            if any(self._is_root(edge) or self._reached.get(edge[0]) for edge in parents):
                self._reached[node] = True
            elif unknown:
                stack.extend(unknown)
                continue
            else:
                self._reached[node] = False
            stack.pop()
        return self._reached[tensor.grad_fn]

    def clear(self) -> None:
        """Drop the roots and the graph's nodes (and the activations they hold)."""
        self.tensors.clear()
        self._edges.clear()
        self._leaves.clear()
        self._reached.clear()

    def _is_root(self, edge: Edge) -> bool:
        return edge in self._edges or id(getattr(edge[0], "variable", None)) in self._leaves  # AccumulateGrad.variable
