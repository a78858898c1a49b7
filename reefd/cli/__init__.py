"""reefctl: a kubectl-style command line over reefd's admin HTTP API (standard library only)."""
