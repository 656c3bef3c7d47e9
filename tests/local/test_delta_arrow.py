"""isbflow.local.delta_arrow: a local Delta table's rows read through pyarrow's own file system
(the default Python one can abort the process at exit) are the rows deltalake reads; and no
other module of the package reads a table's rows any other way."""

from __future__ import annotations

import re

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake
from pyarrow import fs

from isbflow.local.delta_arrow import arrow_dataset, arrow_filesystem, arrow_table
from tests.conftest import ROOT


def test_rows_read_through_pyarrows_file_system_are_deltalakes(tmp_path):
    path = tmp_path / "t w"  # a space: the table's URI is percent-encoded
    for i in range(3):
        write_deltalake(str(path), pa.table({"k": [f"{i}-{j}" for j in range(5)], "n": list(range(5))}), mode="append")
    t = DeltaTable(str(path))
    assert isinstance(arrow_filesystem(t), fs.SubTreeFileSystem)
    assert arrow_table(t).sort_by("k") == t.to_pyarrow_table().sort_by("k")
    assert arrow_table(t, columns=["n"]).num_columns == 1 and arrow_dataset(t).count_rows() == 15


def test_no_module_reads_rows_through_deltalakes_default_file_system():
    calls = re.compile(r"\.to_pyarrow_(table|dataset)\(")
    found = [str(p.relative_to(ROOT)) for p in (ROOT / "isbflow").rglob("*.py")
             if p.name != "delta_arrow.py" and calls.search(p.read_text())]
    assert found == [], "read through isbflow.local.delta_arrow (its docstring says why)"
