"""SkillClaw (AMAP-ML, arXiv:2604.08377) as a harness recipe: agent feedback -> edits of the skill pool.

No GPU and no torch: the proposer is a model reefd calls with the recipe's prompt; see README.md.
"""
