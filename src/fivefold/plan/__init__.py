"""Analytical planner: parameter counts, FLOPs and memory from config objects alone (no torch.distributed)."""
