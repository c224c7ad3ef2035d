"""Training loop, optimizer and schedule, metrics, checkpoints."""
