"""The embedded engine worker: a torch process that speaks a subset of SGLang's HTTP contract.

reefd starts it as `python -m reefd.worker --model PATH --port N` and never imports it;
importing this package itself stays cheap (torch is imported by the submodules that need it).
"""
