"""Parallelism applied to the plain model from outside: mesh, data parallelism (DDP, ZeRO)."""
