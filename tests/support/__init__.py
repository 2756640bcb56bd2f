"""What the tests build: hand-made plans, reference models from transformers, checkpoints to edit,
logits probes and kernel cases."""
