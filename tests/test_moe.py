"""The mixture-of-experts block on one process: routing, kernels, losses, capacity, counts, presets, bad input."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import JobConfig
from fivefold.errors import ConfigError
from fivefold.model.config import ModelConfig
from fivefold.model.llama import build_model, materialize
from fivefold.model.moe import MoE, capacity_mask
from fivefold.model.presets import get_preset
from fivefold.parallel.validate import check_config
from fivefold.plan.flops import count_parameters, flops_per_token


def moe_config(**changes) -> ModelConfig:
    base = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16, n_experts=4, moe_top_k=2,
                       moe_ffn_dim=24)
    config = dataclasses.replace(base, **changes)
    config.validate()
    return config


def block(config: ModelConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(config, 0)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, choice by choice: the textbook definition the block must equal."""
    c = moe.config
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    for t, token in enumerate(flat):
        logits = moe.router.weight.float() @ token.float()
        scores = logits.softmax(-1) if c.moe_score == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores + moe.expert_bias, c.moe_top_k).indices
        weights = scores[chosen]
        if c.moe_norm_topk:
            weights = weights / weights.sum()
        for e, w in zip(chosen.tolist(), weights * c.moe_route_scale):
            expert = moe.experts[str(e)]
            out[t] += w * expert.w2(F.silu(expert.w1(token)) * expert.w3(token))
        if moe.shared is not None:
            shared = moe.shared.w2(F.silu(moe.shared.w1(token)) * moe.shared.w3(token))
            if moe.shared_gate is not None:
                shared = torch.sigmoid(moe.shared_gate.weight @ token) * shared
            out[t] += shared
    return out.view_as(x)


@pytest.mark.parametrize("changes", [
    {},
    {"moe_score": "sigmoid", "moe_norm_topk": False, "moe_route_scale": 2.5, "moe_bias_update_rate": 0.1},
    {"moe_shared_experts": 1, "moe_top_k": 1},
    {"moe_shared_ffn_dim": 40, "moe_shared_gate": True, "moe_norm_topk": False},
], ids=["softmax", "sigmoid-bias-scale", "shared-top1", "qwen2-gated-shared"])
@pytest.mark.parametrize("kernel", ["loop", "grouped"])
def test_block_equals_the_token_by_token_definition(changes, kernel):
    moe = block(moe_config(**changes))
    moe.kernel.kind = kernel
    if moe.config.moe_bias_update_rate:
        moe.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=1e-5, atol=1e-5)


def test_grouped_and_loop_kernels_give_the_same_gradients():
    config = moe_config()
    grads = {}
    for kernel in ("loop", "grouped"):
        moe = block(config)
        moe.kernel.kind = kernel
        x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        (moe(x) ** 2).sum().backward()
        grads[kernel] = [x.grad, *(p.grad for p in moe.parameters())]
    for a, b in zip(grads["loop"], grads["grouped"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_grouped_kernel_runs_in_bf16_under_autocast_as_the_loop_kernel_does():
    """autocast casts neither torch._grouped_mm nor an autograd.Function: the grouped kernel casts its rows and
    stacked weights itself, so under bf16 autocast its GEMMs run in bf16 (and keep bf16 stacks for backward)
    like the loop kernel's Linear layers; both give the same output and fp32 gradients to bf16 rounding."""
    config = moe_config(dim=64, moe_ffn_dim=64)
    results = {}
    for kernel in ("loop", "grouped"):
        moe = block(config)
        moe.kernel.kind = kernel
        x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = moe(x)
        (out.float() ** 2).sum().backward()
        results[kernel] = (out.float(), [x.grad, *(p.grad for p in moe.parameters())])
    torch.testing.assert_close(results["grouped"][0], results["loop"][0], rtol=0, atol=0)  # the same bf16 GEMMs
    for a, b in zip(results["grouped"][1], results["loop"][1]):  # gradients of ~5e3: bf16 rounding apart
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0.02 * b.abs().max().item())


def test_the_grouped_kernel_keeps_bf16_stacks_under_autocast():
    """What autograd keeps for the grouped kernel under bf16 autocast: the stacked expert weights in bf16 (half the
    bytes of the fp32 stacks it kept before it cast them), as the planner counts them at 2 bytes per element."""
    moe = block(moe_config(dim=64, moe_ffn_dim=64))
    moe.kernel.kind = "grouped"
    x = torch.randn(2, 5, 64)
    stacks = []

    def pack(tensor):
        if tensor.dim() == 3 and tensor.shape[0] == moe.config.n_experts:
            stacks.append(tensor.dtype)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        moe(x)
    assert stacks == [torch.bfloat16] * 3  # w1, w3, w2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_kernel_stacks_and_casts_in_one_copy_equal_to_stack_then_cast(dtype):
    """The grouped kernel's stack (model/moe.py _StackCast) writes the cast stack straight from the fp32 weights;
    its forward and backward equal torch.stack(...).to(dtype)'s bit for bit, and no fp32 stack is made on the way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fivefold.model.moe import _StackCast

    weights = [torch.randn(6, 4, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in range(5)]
    made = []

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made.extend((t.dim(), t.dtype) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    with Outputs():
        ours = _StackCast.apply(dtype, *weights)
    theirs = torch.stack(weights).to(dtype)
    assert ours.dtype == dtype and torch.equal(ours, theirs)
    assert (3, torch.float32) not in made or dtype == torch.float32
    grad = torch.randn(theirs.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    for a, b in zip(torch.autograd.grad(ours, weights, grad), torch.autograd.grad(theirs, weights, grad)):
        assert a.dtype == torch.float32 and torch.equal(a, b)


@pytest.mark.parametrize("x_dtype,rows_dtype,weights_dtype", [
    (torch.float32, torch.float32, torch.float32),  # fp32 training
    (torch.float32, torch.bfloat16, torch.bfloat16),  # bf16 autocast: fp32 residual stream, bf16 rows and router
    (torch.bfloat16, torch.bfloat16, torch.float32),  # ZeRO's bf16 compute weights: bf16 stream, fp32 router
], ids=["fp32", "autocast", "bf16-weights"])
def test_the_combine_computes_what_autograd_ops_do_and_keeps_only_the_rows(x_dtype, rows_dtype, weights_dtype):
    """`combine` (model/moe.py `_Combine`) gives the output and both gradients of its definition written with
    autograd's ops, bit for bit and in the same dtypes, while keeping for backward only the expert rows as they
    came, the weights and the token indices: the definition also kept the fp32 weighted rows and their fp32 copy."""
    from fivefold.model.moe import combine
    from fivefold.train.memory import saved_activation_bytes

    def by_ops(x, rows, tokens, weights):
        weighted = (rows.float() * weights.unsqueeze(1)).to(x.dtype)
        return torch.zeros_like(x).index_add(0, tokens, weighted)

    T, k, h = 37, 3, 24
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(T, h, generator=generator).to(x_dtype)
    tokens = torch.randint(0, T, (T * k,), generator=generator)
    rows0 = torch.randn(T * k, h, generator=generator).to(rows_dtype)
    weights0 = torch.rand(T * k, generator=generator).to(weights_dtype)
    grad = torch.randn(T, h, generator=generator).to(x_dtype)
    results, kept = [], []
    for fn in (by_ops, combine):
        rows, weights = rows0.clone().requires_grad_(), weights0.clone().requires_grad_()
        out = []
        kept.append(saved_activation_bytes(lambda: out.append(fn(x, rows, tokens, weights)), exclude=[rows, weights]))
        out[0].backward(grad)
        results.append((out[0], rows.grad, weights.grad))
    for ours, theirs in zip(results[1], results[0]):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    assert kept[1] == tokens.numel() * 8  # the rows and weights are the caller's; the indices are int64
    # the definition's extra: the rows cast to fp32 (the rows themselves when fp32) and the weighted rows, in x's dtype
    extra = T * k * h * ((0 if rows_dtype == torch.float32 else 4) + x.element_size())
    assert kept[0] - kept[1] == extra


def test_an_expert_without_tokens_gets_a_zero_gradient():
    """Every rank must produce every expert's gradient (ZeRO reduce-scatters and DDP buckets wait for it)."""
    moe = block(moe_config())
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0] = moe.router.weight[1, 0] = 50.0  # every token with x0 > 0 picks experts 0, 1
    x = torch.randn(1, 6, 32).abs()
    moe(x).sum().backward()
    assert moe.experts["3"].w1.weight.grad is not None and not moe.experts["3"].w1.weight.grad.any()
    assert moe.experts["0"].w1.weight.grad.any()


def test_switch_and_sequence_losses_and_z_loss_match_their_formulas():
    config = moe_config(moe_aux_loss="switch", moe_z_loss_coeff=0.1)
    moe = block(config)
    x = torch.randn(2, 6, 32)
    routing, logits, scores = moe.route(x)
    loss, record = moe.balancing_loss(routing, logits, scores, 2, 6)
    E, k, T = 4, 2, 12
    f = torch.bincount(routing.experts.reshape(-1), minlength=E).float() / (T * k)
    P = scores.mean(0)
    switch = E * (f * P).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    torch.testing.assert_close(loss, config.moe_aux_coeff * switch + 0.1 * z)
    assert record[3] == pytest.approx(float(switch.detach())) and record[4] == pytest.approx(float(z.detach()))

    moe.config = dataclasses.replace(config, moe_aux_loss="sequence", moe_z_loss_coeff=0.0)
    loss, _ = moe.balancing_loss(routing, logits, scores, 2, 6)
    per_sequence = []
    for b in range(2):
        ids = routing.experts.view(2, 6, k)[b].reshape(-1)
        f = torch.bincount(ids, minlength=E).float() / (6 * k)
        per_sequence.append(E * (f * scores.view(2, 6, E)[b].mean(0)).sum())
    torch.testing.assert_close(loss, config.moe_aux_coeff * torch.stack(per_sequence).mean())


def test_balancing_loss_gets_its_gradient_scaled_by_the_micro_batch_share():
    """The loss rides on the output: d(objective)/d(router) includes coeff * d(aux) * loss_scale."""
    config = moe_config(moe_aux_loss="switch", moe_aux_coeff=1.0)
    moe = block(config)
    x = torch.randn(2, 6, 32)
    moe.loss_scale = 0.5
    (moe(x).sum() * 0).backward()  # only the balancing loss's gradient reaches the router
    with_aux = moe.router.weight.grad.clone()
    moe.zero_grad()
    routing, logits, scores = moe.route(x)
    (0.5 * moe.balancing_loss(routing, logits, scores, 2, 6)[0]).backward()
    torch.testing.assert_close(with_aux, moe.router.weight.grad)
    stats = moe.stats.take()
    assert stats.micro_batches == 1 and stats.load.sum() == 2 * 6 * 2


def test_a_dropless_grouped_block_reads_nothing_back_to_the_host_until_its_statistics_are_taken(monkeypatch):
    """Reading a device tensor on the host (item, float, tolist, a copy to the CPU) makes the host wait for the GPU;
    done in every MoE layer it kept kernel launches from running ahead. The grouped kernel's offsets and the
    layer's statistics stay on the device until `take` (once per step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = []

    class HostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                reads.append(func)
            return func(*args, **(kwargs or {}))

    original = torch.Tensor.tolist

    def counted_tolist(tensor):
        reads.append("tolist")
        return original(tensor)

    config = moe_config(moe_aux_loss="switch", moe_aux_coeff=0.01, moe_z_loss_coeff=0.001)
    moe = block(config)
    moe.kernel.kind = "grouped"
    x = torch.randn(2, 6, 32, requires_grad=True)
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    with HostReads():
        moe(x).sum().backward()
    monkeypatch.undo()
    assert reads == []
    stats = moe.stats.take()
    assert stats.load.device.type == "cpu" and stats.load.sum() == 2 * 6 * 2
    assert isinstance(stats.aux_loss, float) and stats.aux_loss > 0 and isinstance(stats.z_loss, float)
    moe.kernel.kind = "loop"  # which must slice its rows by the counts on the host
    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    moe(x)
    assert reads == ["tolist"]


def test_capacity_keeps_the_best_scored_or_the_earliest_per_sequence_and_expert():
    experts = torch.tensor([[[0], [0], [0], [1]]])
    weights = torch.tensor([[[0.2], [0.9], [0.5], [0.7]]])
    by_probability = capacity_mask(experts, weights, 2, 2, "probability")
    by_position = capacity_mask(experts, weights, 2, 2, "position")
    assert by_probability.view(-1).tolist() == [False, True, True, True]
    assert by_position.view(-1).tolist() == [True, True, False, True]


def test_dropped_assignments_contribute_nothing():
    config = moe_config(moe_capacity_factor=0.25, moe_drop_policy="position", moe_top_k=1)
    moe = block(config)
    x = torch.randn(1, 8, 32)
    routing, _, _ = moe.route(x)
    capacity = math.ceil(0.25 * 8 * 1 / 4)
    kept = routing.keep.view(-1)
    assert all(int(((routing.experts.view(-1) == e) & kept).sum()) <= capacity for e in range(4))
    out = moe(x).view(8, 32)
    assert not out[~kept].any()  # no shared expert: a fully dropped token's MLP output is zero


def test_bias_step_raises_underloaded_experts():
    moe = block(moe_config(moe_bias_update_rate=0.01))
    moe.update_bias(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    assert moe.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])


def test_moe_layer_choice():
    config = moe_config(n_layers=6, moe_first_dense=1, moe_layer_freq=2)
    assert config.moe_layers == [1, 3, 5]
    model = build_model(config)
    assert [isinstance(model.layers[str(i)].feed_forward, MoE) for i in range(6)] == [False, True, False, True, False, True]


def test_parameter_count_equals_the_instantiated_model():
    config = moe_config(n_layers=4, moe_first_dense=1, moe_shared_experts=1, moe_shared_gate=True, qk_norm="head")
    model = materialize(build_model(config))
    count = count_parameters(config)
    assert count.total == sum(p.numel() for p in model.parameters())
    per_expert = 3 * 32 * 24
    assert count.total - count.active == 3 * (4 - 2) * per_expert  # 3 MoE layers, 2 of 4 experts idle per token
    assert flops_per_token(config, 16) - flops_per_token(dataclasses.replace(config, moe_top_k=1), 16) == 6 * 3 * per_expert


@pytest.mark.parametrize("name,total,active", [
    ("mixtral-8x7b", 46.7e9, 12.9e9),  # Mistral AI's announcement: 46.7B total, 12.9B per token
    ("qwen1.5-moe-a2.7b", 14.3e9, 2.7e9),  # model card: 14.3B total, 2.7B activated
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),  # model card: 30.5B total, 3.3B activated
])
def test_published_moe_sizes(name, total, active):
    """Published one-decimal figures, rounded or truncated: the exact count lies in [figure - 0.05B, figure + 0.1B)."""
    count = count_parameters(get_preset(name))
    assert total - 0.05e9 <= count.total < total + 0.1e9
    assert active - 0.05e9 <= count.active < active + 0.1e9


def _hf_models():
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=64)
    return {
        "mixtral": (transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **small, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
            moe_config(n_kv_heads=2, moe_ffn_dim=24)),
        "qwen2_moe": (transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **small, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=False)),
            moe_config(n_kv_heads=2, moe_ffn_dim=24, moe_shared_ffn_dim=40, moe_shared_gate=True, moe_norm_topk=False,
                       attention_bias="qkv")),
        "qwen3_moe": (transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **small, head_dim=8, intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True)),
            moe_config(n_kv_heads=2, moe_ffn_dim=24, qk_norm="head")),
    }


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_parameter_count_equals_transformers(family):
    hf, ours = _hf_models()[family]
    assert count_parameters(ours).total == sum(p.numel() for p in hf.parameters())


def test_block_equals_transformers_mixtral_block_with_the_same_weights():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf_config = transformers.MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    theirs = MixtralSparseMoeBlock(hf_config)
    ours = block(moe_config())
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        for e in range(4):
            expert = ours.experts[str(e)]
            theirs.experts.gate_up_proj[e].copy_(torch.cat([expert.w1.weight, expert.w3.weight]))
            theirs.experts.down_proj[e].copy_(expert.w2.weight)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("changes,match", [
    ({"model": {"n_experts": 4, "moe_top_k": 5}}, "moe_top_k"),
    ({"model": {"n_experts": 4, "moe_first_dense": 9}}, "no layer is a MoE layer"),
    ({"model": {"n_experts": 4, "moe_score": "tanh"}}, "moe_score"),
    ({"expert_parallel": {"degree": 2}}, "has none"),
    ({"model": {"n_experts": 3}, "expert_parallel": {"degree": 2}}, "not divisible"),
    ({"expert_parallel": {"tensor": 2}}, "has none"),
    ({"model": {"n_experts": 8, "moe_groups": 3}}, "equal groups"),
    ({"model": {"n_experts": 8, "moe_groups": 4, "moe_topk_groups": 5}}, "moe_topk_groups = 5"),
    ({"model": {"n_experts": 8, "moe_top_k": 3, "moe_groups": 4, "moe_topk_groups": 1}}, "at least moe_top_k"),
    ({"model": {"n_experts": 8, "moe_topk_groups": 2}}, "needs group-limited"),
    ({"model": {"rope_mscale_all_dim": 1.0}}, "rope_mscale_all_dim"),
    ({"model": {"n_experts": 4, "moe_ffn_dim": 30}, "expert_parallel": {"tensor": 4}}, "hidden width"),
    ({"model": {"n_experts": 4}, "expert_parallel": {"tensor": 0}}, "expert_parallel.tensor"),
    ({"model": {"n_experts": 4}, "expert_parallel": {"alltoall": "magic"}}, "expert_parallel.alltoall"),
    ({"model": {"n_experts": 4}, "expert_parallel": {"kernel": "magic"}}, "expert_parallel.kernel"),
    ({"model": {"n_experts": 4, "moe_capacity_factor": 1.0}, "context_parallel": {"degree": 2}}, "dropless"),
    ({"model": {"n_experts": 4}, "data_parallel": {"mode": "ps"}, "parameter_server": {"servers": 1}}, "ps"),
    ({"model": {"n_experts": 4, "moe_aux_coeff": -1.0}}, "moe_aux_coeff"),
], ids=lambda v: str(v)[:40])
def test_bad_moe_settings_are_refused_before_any_work(changes, match):
    config = JobConfig()
    for section, values in changes.items():
        setattr(config, section, dataclasses.replace(getattr(config, section), **values))
    with pytest.raises(ConfigError, match=match):
        check_config(config.validate())


def test_eplb_evens_a_skewed_trace():
    """A Zipf-like trace over 16 experts on 4 ranks: contiguous placement leaves one rank with most of the
    load; 2 spare slots per rank, filled with replicas of the hottest experts, bring max/mean to <= 1.1."""
    from fivefold.parallel.expert_placement import contiguous_placement, imbalance, place_experts, replica_counts

    load = [1000.0 / (rank + 1) ** 1.2 for rank in range(16)]
    before = imbalance(load, contiguous_placement(16, 4))
    placement = place_experts(load, 4, 16 // 4 + 2)
    after = imbalance(load, placement)
    assert before > 2.0 and after <= 1.1, (before, after)
    assert all(len(r) == 6 and len(set(r)) == 6 for r in placement)  # full ranks, no expert twice on a rank
    assert sorted({e for r in placement for e in r}) == list(range(16))  # every expert somewhere
    assert sum(1 for r in placement if 0 in r) == replica_counts(load, 24, cap=4)[0] > 1  # the hottest is replicated
    # all load on one expert: it gets a replica on every rank
    assert sum(1 for r in place_experts([100.0] + [0.0] * 7, 4, 3) if 0 in r) == 4


def test_eplb_settings_are_checked():
    with pytest.raises(ConfigError, match="load_from"):
        JobConfig(expert_parallel=dataclasses.replace(JobConfig().expert_parallel, degree=2, replicas=1)).validate()
    with pytest.raises(ConfigError, match="replicas"):
        JobConfig(expert_parallel=dataclasses.replace(JobConfig().expert_parallel, load_from="x")).validate()


def test_expert_degrees_that_do_not_fit_the_ranks_are_refused_before_launch(tmp_path):
    """EP x ETP must divide the ranks holding distinct tokens of a stage: 2 x 2 experts' grid on 2 ranks fails
    before any rank starts, naming both settings."""
    from fivefold.train.launch import check_before_launch

    config = JobConfig()
    config.model = dataclasses.replace(config.model, n_experts=4, moe_ffn_dim=32)
    config.expert_parallel = dataclasses.replace(config.expert_parallel, degree=2, tensor=2)
    config.train = dataclasses.replace(config.train, output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"expert_parallel.degree x expert_parallel.tensor = 2 x 2 must divide"):
        check_before_launch(config.validate(), 2)
    check_before_launch(config.validate(), 4)


def test_zero_over_experts_held_by_one_rank_each_is_refused_before_launch_and_by_the_planner(tmp_path):
    """ZeRO shards the routed experts over their expert-data-parallel group: EP 2 on 2 ranks leaves that group one
    rank, which the launcher and the planner refuse (naming the settings) instead of the ranks at start-up."""
    from fivefold.plan.cluster import PRESETS
    from fivefold.plan.estimate import estimate
    from fivefold.train.launch import check_before_launch

    config = JobConfig()
    config.model = dataclasses.replace(config.model, n_experts=4)
    config.expert_parallel = dataclasses.replace(config.expert_parallel, degree=2)
    config.data_parallel = dataclasses.replace(config.data_parallel, zero_stage=2, shard=2)
    config.train = dataclasses.replace(config.train, output_dir=str(tmp_path / "run"))
    message = r"zero_stage = 2 shards the experts .*degree x tensor = 2 x 1 leaves each expert piece on one rank"
    with pytest.raises(ConfigError, match=message):
        check_before_launch(config.validate(), 2)
    with pytest.raises(ConfigError, match=message):
        estimate(config, 2, PRESETS["h100-sxm"], vocab_size=257)
    config.data_parallel = dataclasses.replace(config.data_parallel, shard=4)
    check_before_launch(config.validate(), 4)  # EDP 2
