"""`python -m lookup_table.ops.localcluster up|down|status` (what `deploy/cluster.sh` runs)."""

from __future__ import annotations

import sys

from lookup_table.ops.localcluster.cli import main

sys.exit(main())
