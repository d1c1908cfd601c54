"""Checkpoints that resume exactly, survive crashes, reshard, and export to Hugging Face.

- :mod:`fitrl.checkpoint.layout`   the on-disk layout; atomic save (temporary name, marker, rename),
                                    retention, finding a checkpoint (no torch)
- :mod:`fitrl.checkpoint.sharded`  one role's sharded state per rank (torch.distributed.checkpoint)
- :mod:`fitrl.checkpoint.manager`  the driver's side: when to save, what a resume restores
- :mod:`fitrl.checkpoint.export`   a checkpoint's actor as a Hugging Face model directory (`fitrl export`)
- :mod:`fitrl.checkpoint.lora`     export of a LoRA checkpoint: PEFT's adapter format, or merged into the base

Import-light: importing the package loads nothing heavy; import the modules.
"""
