"""bench.harness.paired_variants: methods against a variant, paired by seed (brute-force statistics)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats

from bench.harness import paired_variants


def _runs(values: list[float]) -> dict:
    return {"runs": [{"seed": s, "final_val_bpb": v} for s, v in enumerate(values)]}


def test_rows_pair_each_method_with_its_variant(tmp_path, capsys) -> None:
    results = {"methods": {"random": _runs([3.0, 3.1, 3.2]), "a": _runs([3.0, 3.0, 3.3]), "a@x=1": _runs([3.1, 2.9, 3.2]),
                           "b": _runs([2.0, 2.0, 2.0]), "b@x=1": _runs([3.0, 3.01, 2.99])}}
    rows = {r["method"]: r for r in paired_variants.paired_rows(results, "@x=1")}
    assert set(rows) == {"a", "b"}
    d = np.array([3.0, 3.0, 3.3]) - np.array([3.1, 2.9, 3.2])
    assert rows["a"]["diff_mean"] == pytest.approx(d.mean()) and rows["a"]["diff_std"] == pytest.approx(d.std(ddof=1))
    assert rows["a"]["p_value"] == pytest.approx(stats.ttest_1samp(d, 0).pvalue)
    assert rows["a"]["variant_seed_std"] == pytest.approx(np.std([3.1, 2.9, 3.2], ddof=1))
    assert rows["a"]["within_noise"] and not rows["b"]["within_noise"]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    paired_variants.main([str(path), "--variant", "@x=1"])
    assert "| b | 3 | 2.0000, 2.0000, 2.0000 |" in capsys.readouterr().out
    both = {"methods": {"a@x=0": _runs([3.0, 3.1]), "a@x=1": _runs([3.2, 3.3])}}
    assert paired_variants.paired_rows(both, "@x=1", "@x=0")[0]["diff_mean"] == pytest.approx(-0.2)
    with pytest.raises(SystemExit, match="no method"):
        paired_variants.main([str(path), "--variant", "@y=2"])
