"""What a method prefers *within* a domain: kept against rejected candidates of the same domain, from run ledgers.

    python -m bench.studies.within_domain bench/results/default-adamw --methods random,opus,rho --out bench/results/FILE

For every run folder ``<results>/runs/<hash>/<method>/seed<s>`` with a ledger (``train.py`` writes
one by default), each candidate's window is read back from the packed pool (the ledger's
``meta.json`` names the pool, its packing and cache) and described by features a user can act on:

- ``doc_offset``: log₂(1 + tokens from its document's boundary token to the window's start);
- ``doc_length``: log₂ of the length in tokens of the document the window starts in;
- ``boundaries``: boundary tokens inside the window (documents it spans, minus one);
- ``distinct``: distinct token ids among its T + 1 tokens;
- ``whitespace`` / ``punctuation`` / ``digits``: shares of its bytes.

Per micro-batch and domain with both kept and rejected candidates, the difference of the kept
mean and the rejected mean of each feature, in units of that feature's standard deviation over
the domain's pool samples; averaged over micro-batches (weighted by the domain's candidates)
and then over seeds. Random selection's value is 0 up to noise; a large value is a preference the
method's scores carry within domains. Writes ``<out>.json`` and ``<out>.md`` (the table, also printed).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import yaml
from jsonargparse import ArgumentParser

from bench.harness.compare import finished
from selection_callbacks.core.ledger_store import read_ledger, read_meta
from selection_callbacks.data.packing import PackedSplit, pack_source
from selection_callbacks.data.tokenizer import ByteTokenizer

FEATURES = ("doc_offset", "doc_length", "boundaries", "distinct", "whitespace", "punctuation", "digits")
_WHITESPACE = np.frombuffer(b" \t\n\r", dtype=np.uint8)
_PUNCTUATION = np.frombuffer(b"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", dtype=np.uint8)


def sample_features(split: PackedSplit, sample_ids: np.ndarray, boundary_id: int) -> dict[str, np.ndarray]:
    """Each feature of ``FEATURES`` for the windows ``sample_ids`` [n] of a byte-level packed split."""
    windows = split.windows(sample_ids)
    starts = sample_ids.astype(np.int64) * split.seq_len
    doc = np.searchsorted(split.doc_start, starts, side="right") - 1
    doc_end = np.append(split.doc_start[1:], len(split.tokens))
    is_byte = windows < 256
    nbytes = np.maximum(is_byte.sum(1), 1)
    def share(chars):
        return (np.isin(windows, chars) & is_byte).sum(1) / nbytes
    return {
        "doc_offset": np.log2(1 + starts - split.doc_start[np.maximum(doc, 0)]),
        "doc_length": np.log2(np.maximum(doc_end[np.maximum(doc, 0)] - split.doc_start[np.maximum(doc, 0)], 1)),
        "boundaries": (windows == boundary_id).sum(1).astype(np.float64),
        "distinct": np.array([len(np.unique(w)) for w in windows], dtype=np.float64),
        "whitespace": share(_WHITESPACE),
        "punctuation": share(_PUNCTUATION),
        "digits": share(np.arange(48, 58)),
    }


def domain_scales(split: PackedSplit, boundary_id: int, per_domain: int = 4000, seed: int = 0) -> dict[str, dict[str, float]]:
    """Each feature's standard deviation over (up to ``per_domain``) pool samples of each domain."""
    rng = np.random.default_rng(seed)
    out = {}
    for code, name in enumerate(split.domain_names):
        ids = np.flatnonzero(split.sample_domain == code)
        if len(ids) < 2:
            continue
        ids = rng.choice(ids, min(per_domain, len(ids)), replace=False)
        out[name] = {k: float(v.std()) for k, v in sample_features(split, ids, boundary_id).items()}
    return out


def run_preferences(run_dir: Path, split: PackedSplit, scales: dict[str, dict[str, float]], boundary_id: int) -> dict:
    """Per feature: the candidate-weighted mean over (micro-batch, domain) of (kept mean − rejected mean) / σ_domain."""
    table = read_ledger(run_dir).to_pydict()
    ids = np.asarray(table["sample_id"], dtype=np.int64)
    feats = sample_features(split, ids, boundary_id)
    record, selected, domain = np.asarray(table["record"]), np.asarray(table["selected"]), np.asarray(table["domain"])
    sums = dict.fromkeys(FEATURES, 0.0)
    weight = 0
    order = np.lexsort((domain, record))
    keys = np.stack([record[order], np.unique(domain, return_inverse=True)[1][order]], 1)
    cuts = np.flatnonzero(np.any(np.diff(keys, axis=0) != 0, axis=1)) + 1
    for group in np.split(order, cuts):
        kept, name = selected[group], domain[group[0]]
        if kept.all() or not kept.any() or name not in scales:
            continue
        for f in FEATURES:
            sigma = scales[name][f]
            if sigma > 0:
                values = feats[f][group]
                sums[f] += len(group) * (values[kept].mean() - values[~kept].mean()) / sigma
        weight += len(group)
    return {f: sums[f] / weight if weight else float("nan") for f in FEATURES}


def complete(run_dir: Path) -> bool:
    """A run that reached its config's max_steps and has a ledger (runs still training are left out)."""
    config = run_dir / "config.yaml"
    if not config.exists() or not (run_dir / "ledger").is_dir():
        return False
    return finished(run_dir / "metrics.json", int(yaml.safe_load(config.read_text())["trainer"]["max_steps"]))


def markdown(result: dict) -> str:
    lines = [f"# Within-domain preferences: {result['results']}", "",
             "Kept minus rejected candidates of the same domain and micro-batch, in standard deviations of the "
             "feature over the domain's pool samples; mean over seeds (per-seed values in brackets).", "",
             "| method | " + " | ".join(FEATURES) + " |", "|---|" + "---:|" * len(FEATURES)]
    for name, entry in result["methods"].items():
        cells = [f"{statistics.mean(entry[f]):+.3f} ({', '.join(f'{v:+.2f}' for v in entry[f])})" for f in FEATURES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = ArgumentParser(prog="python -m bench.studies.within_domain", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a bench.harness.compare --out folder (its runs/<hash>/<method>/seed<s>)")
    p.add_argument("--methods", required=True, help="comma-separated method names (variants with @ included)")
    p.add_argument("--config-hash", default=None, help="the runs/<hash> folder (default: the only one)")
    p.add_argument("--out", required=True, help="path prefix of the .json and .md")
    a = p.parse_args(argv)
    hashes = [d for d in (a.results / "runs").iterdir() if d.is_dir()] if a.config_hash is None else [a.results / "runs" / a.config_hash]
    if len(hashes) != 1:
        raise SystemExit(f"{a.results / 'runs'} holds {len(hashes)} configurations: pass --config-hash")
    boundary_id = ByteTokenizer.bos_id
    split = scales = None
    result: dict = {"results": str(a.results), "config_hash": hashes[0].name, "methods": {}}
    for name in [m.strip() for m in a.methods.split(",") if m.strip()]:
        runs = sorted(d for d in (hashes[0] / name).glob("seed*") if complete(d))
        if not runs:
            raise SystemExit(f"no finished run of {name!r} with a ledger under {hashes[0]}")
        if split is None:
            meta = read_meta(runs[0])
            if meta.get("subset"):
                raise SystemExit(f"{runs[0]} trained on a subset: within-domain preferences are for online selection")
            split = pack_source(meta["pool"], int(meta["seq_len"]), meta["cache_dir"], progress=False)
            scales = domain_scales(split, boundary_id)
        per_seed = [run_preferences(d, split, scales, boundary_id) for d in runs]
        result["methods"][name] = {"seeds": [d.name for d in runs], **{f: [s[f] for s in per_seed] for f in FEATURES}}
        print(f"[within_domain] {name}: {len(runs)} seed(s)", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    out.with_suffix(".md").write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
