"""fivefold: distributed LLM training on torch.distributed.

The five folds of parallelism are data, tensor, pipeline, context and expert.
This package holds the plain model, the data pipeline, the single-process trainer
and (in later modules) the parallelism applied to the model from outside.
"""

__version__ = "0.1.0"
