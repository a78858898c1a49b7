"""GEPA (arXiv:2507.19457, upstream gepa-ai/gepa): reflective evolution of the harness's texts against labelled
tasks, with Pareto-sampled parents and strict acceptance. Pure daemon side (no torch): `recipe` is a harness
search that reefd's runner drives (reefd/grow/recipes.py HarnessSearch). See README.md for the loop and every default.
"""
