"""Recipes defined only under tests/: users' own recipes, named by dotted path in a scenario."""
