"""Mixture-of-experts bookkeeping of the training loop: expert load, balancing losses, all-to-all cost,
the auxiliary-loss-free bias step (DeepSeek-V3), and the expert-load heat map.

After every optimizer step each MoE layer's routing statistics (recorded during backward, so a
recomputed block counts once) are summed over the ranks that hold the step's distinct tokens, in one
all-reduce for all of a stage's layers. With `model.moe_bias_update_rate` > 0 each layer's bias then
moves towards even load (every rank of the stage computes the same update from the same counts). On
logged steps the stages' summaries are gathered to rank 0 for metrics.jsonl:

    moe_load          {layer: assignments per expert}, over the step (before drops)
    moe_load_by_ep_rank   with expert parallelism: {layer: [assignments per expert made by the tokens of the ranks
                      at EP position i, summed over the expert-parallel groups] for each position i}, the routing
                      that differs from rank to rank (what `fivefold simulate/plan --expert-load` replays)
    moe_imbalance     max over layers of (max expert load / mean expert load)
    moe_dropped       fraction of assignments dropped by capacity, over all layers
    moe_aux_loss      balancing loss, mean over layers and micro-batches (the value its coefficient multiplies)
    moe_z_loss        router z-loss, likewise
    moe_alltoall_ms / moe_alltoall_bytes   this rank's token all-to-all time and bytes sent in the step
    moe_max_received  most rows one dispatch delivered to this rank (compare with the bound at start-up)

`plot_expert_load` draws moe_load over the steps as one heat map per layer (expert_load.png).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from fivefold.model.moe import MoE, load_expert_biases
from fivefold.parallel.expert_parallel import AllToAllMeter, ExpertParallelDispatch, dispatch_bound_bytes, moe_layers


def describe_experts(model, config, dims) -> str:
    """The start-up line: where the experts are and the worst-case dispatch buffer (expert_parallel.py's bound)."""
    t, ep, tp = config.train, config.expert_parallel.degree, config.tensor_parallel
    etp = config.expert_parallel.tensor
    tokens = t.micro_batch_size * t.seq_len // dims.cp // (tp.degree if tp.sequence_parallel else 1)
    dtype_bytes = 2 if t.dtype == "bf16" else 4
    bound = dispatch_bound_bytes(model, tokens, ep, dtype_bytes, config.expert_parallel.replicas, etp)
    where = (f"expert parallel {ep}: {model.n_experts // ep} of {model.n_experts} experts per rank"
             if ep > 1 else f"{model.n_experts} experts on every rank")
    if etp > 1:
        where += f", each split over {etp} expert-tensor-parallel ranks"
    peers = f"ep {ep} x etp {etp}" if etp > 1 else f"ep {ep}"
    return (f"mixture of experts: {len(model.moe_layers)} MoE layers, top-{model.moe_top_k}, {where}; "
            + (f"worst-case dispatch {bound / 2**20:.2f} MiB received per layer and micro-batch "
               f"({peers} x {tokens} tokens x min(k, experts per rank) x dim {model.dim} x {dtype_bytes} B; as much "
               "again returned)" if ep * etp > 1 else "no all-to-all"))


class RoutingReport:
    """Per-step routing statistics and bias updates of this rank's MoE layers."""

    def __init__(self, model: torch.nn.Module, pp_group: dist.ProcessGroup | None, meter: AllToAllMeter | None,
                 by_rank: bool = True):
        self.layers: list[MoE] = moe_layers(model)
        self.pp_group, self.meter = pp_group, meter
        self.by_rank = by_rank  # logging.moe_load_by_rank
        # every rank of a MoE model takes part (a pipeline stage may hold no MoE layer), none of a dense one
        self.active = bool(model.config.n_experts)

    @torch.no_grad()
    def after_step(self, logged: bool, update_bias: bool) -> dict:
        summaries = {}
        if self.layers:
            taken = [m.stats.take() for m in self.layers]
            experts = self.layers[0].n_experts
            ep, position = self.expert_position()
            # per layer: the load, four sums, then with ep > 1 this rank's own load in its EP position's slot, so that
            # the all-reduce also sums each position's load over the expert-parallel groups
            packed = torch.zeros(len(taken), experts + 4 + (experts * ep if ep > 1 else 0), dtype=torch.float64)
            for row, st in zip(packed, taken):
                row[: st.experts] = st.load
                row[st.experts : st.experts + 4] = torch.tensor([st.dropped, st.assignments, st.aux_loss, st.z_loss])
                if ep > 1:
                    start = experts + 4 + position * experts
                    row[start : start + experts] = st.load
            group = self.layers[0].groups.tokens
            if group is not None:
                dist.all_reduce(packed, group=group)
            for m, row, st in zip(self.layers, packed, taken):
                load = row[: m.n_experts]
                if update_bias and m.config.moe_bias_update_rate:
                    m.update_bias(load)
                micro = max(st.micro_batches, 1)
                sums = row[experts : experts + 4].tolist()
                summaries[str(m.layer_id)] = {"load": load.tolist(), "dropped": sums[0], "assignments": sums[1],
                                              "aux": sums[2] / micro, "z": sums[3] / micro,
                                              "max_received": st.max_received,
                                              "by_ep_rank": row[experts + 4 :].view(ep, experts).tolist() if ep > 1 else None}
        seconds, sent, _ = self.meter.take() if self.meter is not None else (0.0, 0, 0)
        if not logged:
            return {}
        if self.pp_group is not None:
            everyone: list = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(everyone, summaries, group=self.pp_group)
            summaries = {k: v for part in everyone for k, v in part.items()}
        if not summaries:
            return {}
        layers = [summaries[k] for k in sorted(summaries, key=int)]
        imbalance = max(max(s["load"]) / (sum(s["load"]) / len(s["load"])) if sum(s["load"]) else 1.0 for s in layers)
        assignments = sum(s["assignments"] for s in layers)
        by_ep_rank = {k: summaries[k]["by_ep_rank"] for k in sorted(summaries, key=int) if summaries[k]["by_ep_rank"]}
        return {"moe_load": {k: summaries[k]["load"] for k in sorted(summaries, key=int)},
                **({"moe_load_by_ep_rank": by_ep_rank} if by_ep_rank else {}),
                "moe_imbalance": imbalance,
                "moe_dropped": sum(s["dropped"] for s in layers) / assignments if assignments else 0.0,
                "moe_aux_loss": sum(s["aux"] for s in layers) / len(layers),
                "moe_z_loss": sum(s["z"] for s in layers) / len(layers),
                "moe_alltoall_ms": seconds * 1e3, "moe_alltoall_bytes": sent,
                "moe_max_received": max(s["max_received"] for s in layers)}

    def expert_position(self) -> tuple[int, int]:
        """(ep, this rank's place in its expert-parallel group); (1, 0) where the experts stay on the rank or the
        positions are not recorded (logging.moe_load_by_rank off)."""
        dispatch = self.layers[0].dispatch if self.layers and self.by_rank else None
        return (dispatch.ep, dispatch.ep_rank) if isinstance(dispatch, ExpertParallelDispatch) else (1, 0)

    def biases(self) -> dict[str, list[float]]:
        """Every stage's layers' balancing biases (collective over the pipeline group)."""
        # biases that balancing moves, or that an imported model brought (DeepSeek-V3's e_score_correction_bias)
        mine = {str(m.layer_id): m.expert_bias.tolist() for m in self.layers
                if m.config.moe_bias_update_rate or bool(m.expert_bias.any())}
        if self.pp_group is None:
            return mine
        everyone: list = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(everyone, mine, group=self.pp_group)
        return {k: v for part in everyone for k, v in part.items()}

    def load_biases(self, biases: dict[str, list[float]]) -> None:
        load_expert_biases(self.layers, biases)


def plot_expert_load(metrics_path: Path, png_path: Path) -> Path | str:
    """Heat maps of each MoE layer's share of assignments per expert over the logged steps (or why none)."""
    records = []
    with open(metrics_path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("moe_load"), dict):
                records.append(record)
    if not records:
        return "no routing statistics logged"
    from fivefold.plotting import pyplot, save_figure

    plt = pyplot()

    layers = sorted(records[-1]["moe_load"], key=int)
    fig, axes = plt.subplots(len(layers), 1, figsize=(8, 1.2 + 1.8 * len(layers)), squeeze=False)
    steps = [r["step"] for r in records]
    for ax, layer in zip(axes[:, 0], layers):
        rows = [r["moe_load"].get(layer) for r in records]
        loads = torch.tensor([row for row in rows if row is not None], dtype=torch.float64)
        share = loads / loads.sum(1, keepdim=True).clamp(min=1)
        image = ax.imshow(share.T.numpy(), aspect="auto", origin="lower", cmap="viridis",
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, share.shape[1] - 0.5))
        ax.set_ylabel(f"layer {layer}\nexpert")
        fig.colorbar(image, ax=ax, label="share of tokens")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle("expert load (share of routed assignments)")
    fig.tight_layout()
    return save_figure(fig, png_path, dpi=100)
