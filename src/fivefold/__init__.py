"""fivefold: distributed LLM training on torch.distributed.

The name is its five folds of parallelism: data, tensor, pipeline, context and expert. The
first four are built (parallel/), applied to a plain PyTorch model from outside; expert
parallelism is not built yet. docs/architecture.md shows how a config becomes a training step.
"""

__version__ = "0.1.0"
