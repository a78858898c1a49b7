"""Practice: experience reefd gathers itself. Tasks from a scenario's practice set, answered by its serving
release, checked by its verifier in a sandbox (verifiers.py, sandbox.py)."""
