"""Plain REINFORCE with a mean baseline: a weight recipe of a user's own, found by its dotted path alone.

`recipe` is its daemon side (no torch), `objective` its trainer side. Nothing in reefd/ names it.
"""
