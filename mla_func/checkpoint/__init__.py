"""Reading checkpoint folders: every file name resolved and checked, safetensors headers checked whole.

The lowest layer of the package: it knows files and tensors, nothing of models.
"""
