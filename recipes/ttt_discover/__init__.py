"""TTT-Discover (arXiv:2601.16175, upstream test-time-training/discover): get better at one hard problem by many
scored attempts. This package is being built up; `entropic` holds the group-relative entropic advantages (pure
Python, float64, no torch), which both the daemon side and the trainer-side objective use.
"""
