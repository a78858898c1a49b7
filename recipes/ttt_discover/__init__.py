"""TTT-Discover (arXiv:2601.16175, upstream test-time-training/discover): get better at one hard problem by many
scored attempts.

`recipe` and `archive` are the daemon side (no torch): grids of attempts at PUCT-chosen states become one trainer
job with entropic leave-one-out advantages (`entropic`, pure Python float64). `objective` imports torch and runs
in the trainer process: the importance-sampling loss with a centered KL penalty to the frozen base. reefd keeps
the steps and the archive (reefd/grow/attempts.py). See README.md for the solver loop, the maths and every default.
"""
