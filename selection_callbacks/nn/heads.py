"""Which ``nn.Linear`` of a language model is its output head, found from the model's structure.

In order, the first rule that names any module wins:

1. marked: an ``is_output_head = True`` attribute, or the name ``lm_head`` (``*.lm_head``);
2. tied: a Linear whose weight *is* an ``nn.Embedding``'s weight (weight tying);
3. vocabulary-sized: the last-registered Linear whose output size is the vocabulary: the model's
   ``config.vocab_size`` when it has one (Hugging Face models, this project's GPT), else the rows
   of its first-registered ``nn.Embedding`` (the token table comes before any position table in
   GPT-2, LLaMA and Hugging Face layouts).

Example::

    output_heads(GPT(cfg))                 # {"lm_head"}
    output_heads(MyLM())                   # {"head"}: Linear(d, V) beside Embedding(V, d)
"""

from __future__ import annotations

from torch import nn

__all__ = ["output_heads", "vocabulary_size"]


def output_heads(model: nn.Module) -> set[str]:
    """Names (as in ``named_modules``) of the model's output head(s); empty when no rule applies."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    marked = {n for n, m in linears if getattr(m, "is_output_head", False) or n.split(".")[-1] == "lm_head"}
    if marked:
        return marked
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    tied = {n for n, m in linears if any(m.weight is e.weight for e in embeddings)}
    if tied:
        return tied
    vocab = vocabulary_size(model)
    sized = [n for n, m in linears if m.out_features == vocab]
    return {sized[-1]} if sized else set()


def vocabulary_size(model: nn.Module) -> int | None:
    """Token ids the model accepts: ``config.vocab_size``, else its first ``nn.Embedding``'s rows; None if neither."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int):
        return vocab
    first = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return None if first is None else first.num_embeddings
