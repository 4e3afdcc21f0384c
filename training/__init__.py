"""Training-side experiments: a byte-level LM built from the lab's layers, the
activation-memory policy (what to compress, what to recompute, per layer) and
the training loop that measures them (python -m training.train --help)."""
