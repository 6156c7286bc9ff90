"""Selection ledger commands: export a run's selected ids as a subset file, or summarise the run.

    selection-callbacks ledger export RUN_DIR --out selected.parquet
    selection-callbacks ledger summary RUN_DIR [--bins 10] [--top 10]

(``python -m selection_callbacks.cli.ledger`` takes the same arguments.)

``export`` writes the subset format ``--data.subset`` reads (parquet, ``sample_id`` + ``weight``
= how often each id was selected), so a new run trains on what the online method chose.
``summary`` prints the domain composition of the selected per step bin and the most and least
selected documents (by ``doc_id`` when the run's pool can be re-opened, else by ``sample_id``).
The ledger itself is written by :class:`selection_callbacks.callbacks.ledger_writer.SelectionLedger`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from jsonargparse import ActionSubCommands, ArgumentParser, Namespace

from selection_callbacks.core.arguments import command_parser
from selection_callbacks.core.ledger_store import LedgerError, read_ledger, read_meta
from selection_callbacks.data.cache import default_cache_dir
from selection_callbacks.data.hf_tokenizer import HFTokenizer
from selection_callbacks.data.packing import pack_source
from selection_callbacks.data.readers import Columns, DataSourceError
from selection_callbacks.data.subset import SubsetError, read_subset, write_subset


def export_subset(run_dir: str | Path, out: str | Path) -> tuple[Path, int, int]:
    """Write the selected sample ids with their selection counts; (path, distinct ids, selections)."""
    out = Path(out)
    if out.suffix != ".parquet":
        raise LedgerError(f"subset files are parquet (what --data.subset reads): name the output *.parquet, not {str(out)!r}")
    table = read_ledger(run_dir)
    subset = read_meta(run_dir).get("subset")
    if subset and Path(subset).exists() and read_subset(subset).kind == "doc_id":
        raise LedgerError(
            f"the run trained on the doc_id subset {subset!r}: its sample ids index that filtered pool, not the pool, "
            "so a sample_id subset would name other sequences"
        )
    chosen = table.filter(table.column("selected"))
    if chosen.num_rows == 0:
        raise LedgerError(f"the ledger of {str(run_dir)!r} holds no selected candidates")
    if chosen.column("sample_id").null_count:
        raise LedgerError("the ledger has no sample ids (the batches carried no 'sample_id'); nothing to export")
    ids, counts = np.unique(chosen.column("sample_id").to_numpy(), return_counts=True)
    return write_subset(out, "sample_id", ids.tolist(), counts.astype(np.float64)), len(ids), int(counts.sum())


def summarize(run_dir: str | Path, bins: int = 10, top: int = 10) -> str:
    """Domain composition of the selected per step bin and the most/least selected documents, as text."""
    table = read_ledger(run_dir)
    meta = read_meta(run_dir)
    steps = table.column("step").to_numpy()
    selected = table.column("selected").to_numpy(zero_copy_only=False)
    micro_batches = len(np.unique(table.column("record").to_numpy()))
    lines = [
        f"ledger of {run_dir}: steps {steps.min()}–{steps.max()}, {micro_batches} micro-batches, world size "
        f"{meta.get('world_size', '?')}, {table.num_rows} candidates, {int(selected.sum())} selected",
        "",
    ]
    lines += _domain_lines(table, steps, selected, bins)
    lines += [""] + _top_lines(table, selected, meta, top)
    return "\n".join(lines)


def _domain_lines(table: pa.Table, steps: np.ndarray, selected: np.ndarray, bins: int) -> list[str]:
    """Per step bin: selected count and each domain's share of the selected (of the candidates in brackets)."""
    column = table.column("domain")
    if column.null_count == len(column):
        return ["no domains recorded (the batches carried no 'domain')"]
    domain = np.asarray(column.to_pylist(), dtype=object)
    names = sorted(set(domain.tolist()) - {None})
    lines = ["domain share of the selected per step bin (share of the candidates in brackets):"]
    width = max(14, *(len(n) + 2 for n in names))
    lines.append(f"{'steps':>13} {'selected':>9} " + " ".join(f"{n:>{width}}" for n in names))
    for group in np.array_split(np.unique(steps), min(bins, len(np.unique(steps)))):
        rows = (steps >= group[0]) & (steps <= group[-1])
        kept = rows & selected
        cells = [
            f"{(domain[kept] == n).sum() / max(kept.sum(), 1):.3f} ({(domain[rows] == n).sum() / rows.sum():.3f})"
            for n in names
        ]
        span = f"{group[0]}–{group[-1]}"
        lines.append(f"{span:>13} {int(kept.sum()):>9} " + " ".join(f"{c:>{width}}" for c in cells))
    return lines


def _top_lines(table: pa.Table, selected: np.ndarray, meta: dict[str, Any], top: int) -> list[str]:
    """The ``top`` most and least selected documents (or samples): times selected / times a candidate."""
    if table.column("sample_id").null_count:
        return ["no sample ids recorded: no per-document counts"]
    sample = table.column("sample_id").to_numpy()
    ids, inverse = np.unique(sample, return_inverse=True)
    seen = np.bincount(inverse, minlength=len(ids))
    chosen = np.bincount(inverse, weights=selected, minlength=len(ids)).astype(np.int64)
    docs_of, why = _doc_lookup(meta)
    if docs_of is None:
        keys, seen_by, chosen_by, unit = [str(i) for i in ids], seen, chosen, f"sample_id ({why})"
    else:  # a sample counts for every document it holds tokens of
        totals: dict[str, list[int]] = {}
        for i, s, c in zip(ids.tolist(), seen.tolist(), chosen.tolist()):
            for doc in docs_of(i):
                t = totals.setdefault(doc, [0, 0])
                t[0], t[1] = t[0] + s, t[1] + c
        keys = list(totals)
        seen_by = np.array([t[0] for t in totals.values()])
        chosen_by = np.array([t[1] for t in totals.values()])
        unit = "doc_id"
    most = np.lexsort((seen_by, -chosen_by))[:top]
    least = np.lexsort((-seen_by, chosen_by / seen_by))[:top]
    lines = []
    for title, order in ((f"most selected by {unit}", most), (f"least selected by {unit}", least)):
        lines.append(f"{title}: selected / seen as a candidate")
        lines += [f"  {keys[j]:>20} {chosen_by[j]:>6} / {seen_by[j]}" for j in order]
    return lines


def _doc_lookup(meta: dict[str, Any]) -> tuple[Callable[[int], list[str]] | None, str]:
    """sample_id → document ids of the run's pool, or (None, why not)."""
    pool, seq_len = meta.get("pool"), meta.get("seq_len")
    if not pool or not seq_len:
        return None, "the ledger does not name its pool"
    if str(pool).endswith(".bin"):
        return None, "token .bin pools carry no document ids"
    try:
        subset = read_subset(meta["subset"]) if meta.get("subset") else None
        doc_filter = subset.ids if subset is not None and subset.kind == "doc_id" else None
        cache = meta.get("cache_dir") or default_cache_dir()
        tokenizer = HFTokenizer(meta["tokenizer"], meta.get("boundary_token")) if meta.get("tokenizer") else None
        columns = Columns(**meta["columns"]) if meta.get("columns") else Columns()
        split = pack_source(pool, int(seq_len), cache, tokenizer, doc_filter, name="pool", progress=False,
                            columns=columns)
    except (DataSourceError, SubsetError, OSError, ValueError) as e:
        return None, f"pool unavailable: {e}"
    return split.sample_doc_ids, ""


def build_parser(parent: ActionSubCommands | None = None, name: str = "ledger") -> ArgumentParser:
    """The ``ledger`` command (``export``, ``summary``), standalone or as subcommand ``name`` of ``parent``."""
    description = __doc__.splitlines()[0]
    parser = command_parser("selection-callbacks ledger", description, parent, name)
    commands = parser.add_subcommands(dest="command", required=True)
    export = ArgumentParser(description="write the selected sample ids (+ counts as weight) as a subset file")
    export.add_argument("run_dir", help="the run folder (holding ledger/) or the ledger folder")
    export.add_argument("--out", required=True, help="subset file to write (.parquet), for --data.subset")
    commands.add_subcommand("export", export, help=export.description)
    summary = ArgumentParser(description="domain composition over time and the most/least selected documents")
    summary.add_argument("run_dir", help="the run folder (holding ledger/) or the ledger folder")
    summary.add_argument("--bins", type=int, default=10, help="step bins of the domain table")
    summary.add_argument("--top", type=int, default=10, help="documents listed as most and as least selected")
    commands.add_subcommand("summary", summary, help=summary.description)
    return parser


def run(ns: Namespace) -> int:
    """Run the command a ``build_parser()`` namespace names; 0, or 1 with the error on stderr."""
    a = ns[ns.command]
    try:
        if ns.command == "export":
            path, distinct, total = export_subset(a.run_dir, a.out)
            print(f"wrote {path}: {distinct} sample ids, {total} selections (weight = times selected)")
        else:
            print(summarize(a.run_dir, a.bins, a.top))
    except (LedgerError, SubsetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m selection_callbacks.cli.ledger``: parse ``argv`` and run its command; the exit status."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
