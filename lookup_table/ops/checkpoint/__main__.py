"""`python -m lookup_table.ops.checkpoint`: the `lookup-table-checkpoint` command."""

from __future__ import annotations

import sys

from lookup_table.ops.checkpoint.cli import main

sys.exit(main())
