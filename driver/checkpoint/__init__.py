"""Checkpoints: ``harmony.save`` and ``harmony.load`` (io.py), the files and their manifest (files.py), their
validation before anything changes (check.py), each rank's part (ranks.py), loading into another world or
plan (reshard.py) and read and write the training state where it lives through runtime/tiers/live.py."""
from harmony.driver.checkpoint.io import load, load_state_dict, save, state_dict

__all__ = ["save", "load", "state_dict", "load_state_dict"]
