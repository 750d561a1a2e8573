"""Harmony inside the training frameworks people already use.

- ``harmony.integrations.transformers.HarmonyTrainer``: Hugging Face's ``transformers.Trainer`` with each step run by
  a compiled module under a memory budget (docs/trainer.md). Needs ``pip install -e ".[trainer]"``.

Nothing here is imported by ``import harmony``: each integration loads its framework when it is imported itself.
"""
