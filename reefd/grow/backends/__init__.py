"""Where weight jobs run (`recipe.backend`), on the daemon's side: `local` trainer processes (local.py), a Ray
cluster through its Jobs REST API (ray_jobs.py), and slime as a Ray job (slime.py). Torch-free."""
