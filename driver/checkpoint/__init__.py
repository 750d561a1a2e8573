"""Checkpoints: ``harmony.save`` (writer.py) and ``harmony.load`` (io.py), the files and their manifest (files.py),
their validation before anything changes (check.py), each rank's part (ranks.py), every rank's part of one save
(saves.py), the model's param groups (groups.py), loading into another world or plan (reshard.py), the model's
weights as nn.Module's state dict has them (module.py); all read and write the training state where it lives
through runtime/tiers/live.py."""
from harmony.driver.checkpoint.io import load, load_training_state_dict, training_state_dict
from harmony.driver.checkpoint.module import load_module_state_dict, module_state_dict
from harmony.driver.checkpoint.writer import save

__all__ = ["save", "load", "training_state_dict", "load_training_state_dict", "module_state_dict",
           "load_module_state_dict"]
