"""Grow: when jobs run, the recipes that make candidates, the runner's stages, and where weight jobs train."""
