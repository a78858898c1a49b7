"""Composite: a weights recipe and a harness recipe on the same batch, one candidate holding both (a bundle).

No torch here: the weights recipe's objective runs in the trainer; see README.md.
"""
