"""Trainer jobs: `python -m reefd.train --spec FILE` turns scored rollouts into a PEFT LoRA candidate.

`spec` (the job's JSON contract) is torch-free so reefd can import it; `loop` and `job` import
torch and run only in the trainer's own process. The losses live with their recipes (`recipes.sao`).
"""


class NonFinite(RuntimeError):
    """A NaN/inf loss or gradient: the job stops before the optimizer applies it (exit 3)."""
