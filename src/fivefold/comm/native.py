"""The backend's own flat all-gather and reduce-scatter, under the names the installed torch prefers.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` and deprecates the old names (a FutureWarning per call); fivefold supports
torch >= 2.5, so every caller (ZeRO, tensor parallelism, `fivefold bench comm`) takes them from here.
"""

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
