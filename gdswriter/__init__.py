"""gdswriter: fast, crash-safe PyTorch checkpoints."""
