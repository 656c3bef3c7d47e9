"""A local Delta table's rows as Arrow, read through pyarrow's own file system.

deltalake's ``to_pyarrow_table`` and ``to_pyarrow_dataset`` read, by default, through a file
system written in Python (its ``DeltaStorageHandler`` inside a ``PyFileSystem``). pyarrow's scan
threads can hold the last reference to it; released while the interpreter shuts down, it needs
the GIL, the thread is ended and the process aborts with "terminate called without an active
exception" (exit 134, apache/arrow#34314): a command could do its work and still exit 134.
Measured with a script that reads a local table and exits, two at a time on a loaded 2-core
machine: 34 aborts in 300 runs through the default file system, none in 300 through pyarrow's
``LocalFileSystem``. So isbflow reads a table's rows through :func:`arrow_table` and
:func:`arrow_dataset`, which hand deltalake pyarrow's own file system rooted at a local table
(a remote table keeps deltalake's).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import DeltaTable
from pyarrow import fs


def arrow_filesystem(table: DeltaTable) -> fs.FileSystem | None:
    """pyarrow's local file system rooted at ``table`` when it is a local table, else None."""
    uri = urlparse(table.table_uri)
    if uri.scheme not in ("", "file"):
        return None
    return fs.SubTreeFileSystem(url2pathname(uri.path), fs.LocalFileSystem())


def arrow_table(table: DeltaTable, **kw: Any) -> pa.Table:
    """``table.to_pyarrow_table(**kw)`` through :func:`arrow_filesystem` (module docstring)."""
    return table.to_pyarrow_table(filesystem=arrow_filesystem(table), **kw)


def arrow_dataset(table: DeltaTable, **kw: Any) -> ds.Dataset:
    """``table.to_pyarrow_dataset(**kw)`` through :func:`arrow_filesystem` (module docstring)."""
    return table.to_pyarrow_dataset(filesystem=arrow_filesystem(table), **kw)
