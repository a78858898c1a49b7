"""Reef: continual learning for AI agents (serve, observe, grow, commit)."""

__version__ = "0.1.0"
