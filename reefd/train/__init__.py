"""Trainer jobs: `python -m reefd.train --spec FILE` turns scored rollouts into a PEFT LoRA candidate.

Two sides. The daemon's: `backends` (where a job runs: the TrainerBackend plug point) and `spec` (the job's JSON
contract) are torch-free, so reefd imports them. The trainer process's: `loop`, `batch` and `objective` import
torch. The losses live with their recipes, as the objective a spec names (`recipes.sao.objective:SAOObjective`).
"""


class NonFinite(RuntimeError):
    """A NaN/inf loss or gradient: the job stops before the optimizer applies it (exit 3)."""
