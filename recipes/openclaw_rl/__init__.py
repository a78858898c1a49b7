"""OpenClaw-RL (arXiv:2603.10165, upstream Gen-Verse/OpenClaw-RL): learn from the conversation itself.

Each served turn is judged from its next state (the user's next message, or a tool's result) by reefd's judge
(reefd/grow/judge.py), which also extracts hindsight hints. `recipe` is the daemon side (no torch): which judged turns
train, and the trainer spec. `objective` and `loss` import torch and run in the trainer process: PPO-clip on the
judge's verdict, plus on-policy distillation from the frozen base prompted with the hint, over the engine's
top-K tokens. See README.md for the maths and every default.
"""
