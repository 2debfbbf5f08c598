"""The read-update-write engine of one replica: apply pushes exactly once, write rows
behind, replay journals at a start (docs/write-behind.md says why it is built so)."""
