"""SAO (Single-Rollout Asynchronous Optimization, arXiv:2607.07508) and its GRPO control.

`recipe` is the daemon side (no torch). `objective` (the trainer-side Objective), `loss` (the DIS policy loss
and both advantage estimators) and `critic` (the value head) import torch and run in the trainer process
(`python -m reefd.train`); this package itself does not, so reefd can name the recipe without loading torch.
See README.md for the maths.
"""

CRITIC_FILE = "critic.safetensors"
