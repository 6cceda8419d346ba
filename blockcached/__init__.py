"""blockcached: the per-host block cache daemon (see DESIGN.md beside this file)."""
