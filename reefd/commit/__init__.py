"""Commit: gates, the release chain (git + LFS, CAS head), artifact checks, trials and the reconciler."""
