"""The diff a shadow reprocess reports per sink: rows added, removed and changed, per column, with samples.

Contract: :func:`diff_rows` compares two Arrow tables of one sink's rows (the
live rows of the range and the rows the current code makes for it), matched
on key columns (``_isb_id`` for a raw sink). A key only in the new rows is
*added*, only in the old ones *removed*; a key in both whose row differs in any
other column is *changed* (nulls compare equal to nulls; a column only one side
has counts as null on the other). Per column: how many matched rows differ in
it. Samples: the first ``sample`` keys of each kind in key order, so the same
inputs always give the same report. Pure Arrow, no Spark, nothing written; the
result is plain JSON (values a JSON encoder cannot take are shown as text).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

#: samples kept per kind (added, removed, changed)
SAMPLES = 5
_NULL = "\x00null"


def _key_strings(t: pa.Table, keys: Sequence[str]) -> pa.Array:
    """One string per row naming its key (composite keys joined; nulls distinct from any text)."""
    parts = [pc.fill_null(t.column(k).cast(pa.string()), _NULL).combine_chunks() if t.num_rows
             else pa.array([], pa.string()) for k in keys]
    if len(parts) == 1:
        return parts[0]
    return pc.binary_join_element_wise(*parts, "\x1f")


def _plain(v: Any) -> Any:
    if isinstance(v, (datetime, date, time)):
        return v.isoformat()
    if isinstance(v, Decimal):
        return str(v)
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _differs(a: pa.ChunkedArray | pa.Array, b: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Row-wise 'not the same value' (null == null), as a boolean mask."""
    n = len(a)
    if n == 0:
        return np.zeros(0, dtype=bool)
    try:
        if a.type != b.type:
            b = b.cast(a.type)
        ne = pc.fill_null(pc.not_equal(a, b), False)
        one_null = pc.xor(pc.is_null(a), pc.is_null(b))
        return pc.or_(ne, one_null).to_numpy(zero_copy_only=False).astype(bool)
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):  # lists, structs, maps
        return np.array([x != y for x, y in zip(a.to_pylist(), b.to_pylist(), strict=True)], dtype=bool)


def _column(t: pa.Table, name: str, like: pa.DataType) -> pa.ChunkedArray:
    return t.column(name) if name in t.column_names else pa.chunked_array([pa.nulls(t.num_rows, like)])


def diff_rows(old: pa.Table, new: pa.Table, keys: Sequence[str], sample: int = SAMPLES) -> dict[str, Any]:
    """What changes from ``old`` to ``new`` (module docstring); each key must appear once per side.

    Returns ``{"keys", "rows_before", "rows_after", "added", "removed", "changed", "unchanged",
    "columns": {column: rows changed in it}, "samples": {"added": [row], "removed": [row],
    "changed": [{"key": {...}, "changes": {column: [old, new]}}]}}``.
    """
    keys = list(keys)
    old_k, new_k = _key_strings(old, keys), _key_strings(new, keys)
    pos_in_old = pc.index_in(new_k, value_set=old_k)  # per new row: its old row, or null
    matched_new = pc.is_valid(pos_in_old).to_numpy(zero_copy_only=False).astype(bool) if len(new_k) \
        else np.zeros(0, dtype=bool)
    in_new = pc.is_in(old_k, value_set=new_k).to_numpy(zero_copy_only=False).astype(bool) if len(old_k) \
        else np.zeros(0, dtype=bool)
    new_idx = np.flatnonzero(matched_new)
    old_idx = pos_in_old.filter(pa.array(matched_new)).to_numpy(zero_copy_only=False).astype(np.int64) \
        if len(new_idx) else np.zeros(0, dtype=np.int64)
    # matched pairs in key order, so samples do not depend on file order
    pair_keys = new_k.take(pa.array(new_idx, pa.int64()))
    order = np.asarray(pc.sort_indices(pair_keys).to_numpy(zero_copy_only=False), dtype=np.int64)
    new_idx, old_idx = new_idx[order], old_idx[order]
    names = [c for c in dict.fromkeys([*new.column_names, *old.column_names]) if c not in keys]
    a_rows, b_rows = old.take(pa.array(old_idx, pa.int64())), new.take(pa.array(new_idx, pa.int64()))
    changed_any = np.zeros(len(new_idx), dtype=bool)
    per_column: dict[str, int] = {}
    masks: dict[str, np.ndarray] = {}
    for c in names:
        like = (new.schema.field(c) if c in new.column_names else old.schema.field(c)).type
        m = _differs(_column(a_rows, c, like), _column(b_rows, c, like))
        per_column[c], masks[c] = int(m.sum()), m
        changed_any |= m

    def rows_of(t: pa.Table, mask: np.ndarray, ks: pa.Array) -> list[dict]:
        picked = np.flatnonzero(mask)
        if not len(picked):
            return []
        first = np.asarray(pc.sort_indices(ks.take(pa.array(picked, pa.int64()))).to_numpy(
            zero_copy_only=False), dtype=np.int64)[:sample]
        return [_plain(r) for r in t.take(pa.array(picked[first], pa.int64())).to_pylist()]

    changes = []
    for i in np.flatnonzero(changed_any)[:sample]:
        key = {k: _plain(b_rows.column(k)[int(i)].as_py()) for k in keys}
        changes.append({"key": key, "changes": {
            c: [_plain(_column(a_rows, c, pa.null())[int(i)].as_py()) if c in a_rows.column_names else None,
                _plain(_column(b_rows, c, pa.null())[int(i)].as_py()) if c in b_rows.column_names else None]
            for c in names if masks[c][i]}})
    changed = int(changed_any.sum())
    return {
        "keys": keys, "rows_before": old.num_rows, "rows_after": new.num_rows,
        "added": int((~matched_new).sum()), "removed": int((~in_new).sum()), "changed": changed,
        "unchanged": len(new_idx) - changed, "columns": per_column,
        "samples": {"added": rows_of(new, ~matched_new, new_k), "removed": rows_of(old, ~in_new, old_k),
                    "changed": changes},
    }


def summary_line(diff: dict[str, Any] | None) -> str:
    """``+added -removed ~changed (column n, ...)`` for a terminal or a log."""
    if not diff:
        return "no diff"
    cols = ", ".join(f"{c} {n:,}" for c, n in diff.get("columns", {}).items() if n)
    return (f"+{diff['added']:,} added, -{diff['removed']:,} removed, ~{diff['changed']:,} changed, "
            f"{diff['unchanged']:,} unchanged" + (f" (changed columns: {cols})" if cols else ""))
