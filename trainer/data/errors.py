"""The one error of the data readers.

`DataError` (also a `lookup_table.errors.LookupTableError` and a `ValueError`):
the user's data or spec is wrong; fix the file or the options.
"""

from __future__ import annotations

from lookup_table.errors import LookupTableError


class DataError(LookupTableError, ValueError):
    """The data or its spec is wrong: unknown kind or column, missing file, bad value.

    The message names the file, the row (1-based, header excluded) or the column,
    and, for column errors, lists the columns the file has.
    """
