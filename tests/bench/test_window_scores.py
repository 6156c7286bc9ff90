"""bench.studies.window_scores: windows as long as the rows score as the whole rows, alone and in context."""

from __future__ import annotations

import pytest
import torch

TINY = """
trainer: {max_steps: 20}
model:
  config: {n_layer: 1, n_head: 2, n_embd: 32, vocab_size: 320}
  optimizer: adamw
  lr: 0.003
  warmup_steps: 2
data: {seq_len: 32, batch_size: 4, ratio: 0.5}
"""


def test_whole_row_windows_rank_as_the_whole_rows_and_shorter_ones_differ(tiny_corpus, tmp_path) -> None:
    from bench.studies import window_scores

    (tmp_path / "tiny.yaml").write_text(TINY)
    threads = torch.get_num_threads()
    result = window_scores.main(["--config", str(tmp_path / "tiny.yaml"), "--pool", tiny_corpus["pool"], "--target",
                                 tiny_corpus["target"], "--val", tiny_corpus["val"], "--steps", "3", "--windows", "32,8",
                                 "--superbatches", "3", "--reference-steps", "2", "--out", str(tmp_path / "ws")])
    assert torch.get_num_threads() == threads
    rows = {(r["method"], r["window"], r["context"]): r for r in result["rows"]}
    assert len(rows) == 6 and (result["N"], result["K"], result["T"]) == (8, 4, 32)
    for method in ("rho", "opus"):
        whole = rows[(method, 32, False)]  # a window as long as the row is the row, with no prefix to add
        assert (whole["median_spearman"], whole["mean_top_k_overlap"]) == (pytest.approx(1.0), 1.0)
        alone, in_context = rows[(method, 8, False)], rows[(method, 8, True)]
        assert (alone["tokens_per_candidate"], in_context["tokens_per_candidate"]) == (8, 32)
        assert all(-1 <= r < 1 for r in alone["spearman"]) and alone["spearman"] != in_context["spearman"]
    assert (tmp_path / "ws.md").read_text().count("| opus |") == 3
    with pytest.raises(SystemExit, match="--methods"):
        window_scores.main(["--config", str(tmp_path / "tiny.yaml"), "--pool", tiny_corpus["pool"], "--target",
                            tiny_corpus["target"], "--val", tiny_corpus["val"], "--methods", "classact", "--steps", "0",
                            "--superbatches", "1", "--reference-steps", "1", "--out", str(tmp_path / "x")])
