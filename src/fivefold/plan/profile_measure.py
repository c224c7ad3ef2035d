"""`fivefold bench compute`: time a model's passes on one accelerator and make its profile (plan/profile.py).

The parts the planner prices (a dense and a MoE block, the attention core, the head with the loss) are
timed forward and backward on a micro-batch of the job's shape (the MoE block with the job's expert
kernel, `expert_kernel`: on an H200 the loop kernel's MoE step took 2.9 times the grouped one's, so a profile
of one prices the other wrongly and is refused); the blocks are then scaled to the whole
model's measured pass, whose weights and activations no longer sit in a cache as one block's do. On a
CPU host `measure_on_ranks` runs as many measuring processes at once as the job has ranks.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from fivefold.plan.profile import MODEL_KEYS, ComputeProfile


def measure_on_ranks(config, ranks: int, threads: int, vocab_size: int = 0, repeats: int = 10) -> ComputeProfile:
    """A CPU host's profile as a job of `ranks` ranks sees it: `ranks` processes of `threads` threads measuring at
    once (they share the cores and the memory bandwidth, as the job's ranks do), each part the median over them."""
    import multiprocessing

    if ranks == 1:
        return _measure_rank(config, threads, vocab_size, repeats, None)
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(ranks), context.Queue()
    workers = [context.Process(target=_measure_rank, args=(config, threads, vocab_size, repeats, barrier, results))
               for _ in range(ranks)]
    for worker in workers:
        worker.start()
    found = [results.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join()
    parts = {key: statistics.median(getattr(p, key) for p in found) for key in ("block", "moe_block", "core", "head")}
    return dataclasses.replace(found[0], **parts)


def _measure_rank(config, threads: int, vocab_size: int, repeats: int, barrier=None, results=None) -> ComputeProfile:
    import torch

    before = torch.get_num_threads()  # measured in the caller's process (one rank): leave its threads as they were
    torch.set_num_threads(threads)
    try:
        if barrier is not None:
            barrier.wait()
        profile = measure_profile(config, vocab_size, repeats)
    finally:
        torch.set_num_threads(before)
    if results is not None:
        results.put(profile)
    return profile


def expert_kernel(config, model_config, dtype: str) -> str:
    """The expert kernel the job's MoE layers run on one rank (`grouped` or `loop`; "" without experts)."""
    from fivefold.model.moe import resolve_expert_kernel

    if not model_config.n_experts:
        return ""
    return resolve_expert_kernel(config.expert_parallel.kernel, model_config.dim, model_config.expert_hidden_dim,
                                 2 if dtype == "bf16" else 4)


def measure_profile(config, vocab_size: int = 0, repeats: int = 10, device: str = "cpu") -> ComputeProfile:
    """Time the passes of `config`'s model on one accelerator (`device`): a dense and a MoE block (the first of
    each kind), the attention core and the head with the loss, for one micro-batch of the job's shape in its
    compute dtype (compiled under train.compile and the chunked head under train.loss_chunk_tokens, as the trainer runs them), each forward and backward together
    (the median of `repeats` after two warm-ups, which compile); a part's
    profile is a third of it, the forward the planner prices backward at twice (on this project's CPU a
    block's backward took 2.4-2.6 times its forward, so the forward alone priced steps 15-25% short)."""
    import torch

    from fivefold.model.llama import attention_core, build_model, materialize
    from fivefold.model.moe import ExpertKernel, MoE
    from fivefold.parallel.compile import apply_compile, compiled_loss
    from fivefold.parallel.output_loss import OutputLoss, cross_entropy_sum
    from fivefold.parallel.parallelize import DTYPES
    from fivefold.plan.estimate import compute_dtype, model_for
    from fivefold.plan.parameters import first_block

    model_config = model_for(config, vocab_size)
    dtype = compute_dtype(config)
    target = torch.device(device)
    model = materialize(build_model(model_config), target)
    b, s, dim = config.train.micro_batch_size, config.train.seq_len, model_config.dim
    generator = torch.Generator(device=target).manual_seed(0)
    x = torch.randn(b, s, dim, device=target, generator=generator)
    cos, sin = model.rope(torch.arange(s, device=target))
    autocast = torch.autocast(target.type, dtype=torch.bfloat16, enabled=dtype == "bf16")

    def timed(forward, inputs: tuple) -> float:
        """A third of the median forward and backward (the planner's pass, backward priced at twice it)."""
        times = []
        for i in range(repeats + 2):
            for tensor in inputs:
                tensor.grad = None
            if target.type == "cuda":
                torch.cuda.synchronize(target)
            start = time.perf_counter()
            with autocast:
                out = forward()
            out.float().sum().backward()
            if target.type == "cuda":
                torch.cuda.synchronize(target)
            if i >= 2:
                times.append(time.perf_counter() - start)
        return statistics.median(times) / 3

    # the job's passes as its trainer runs them (parallel/parallelize.py build_step): under train.compile the
    # blocks and the plain loss compiled; with train.loss_chunk_tokens the chunked head applying the projection
    t = config.train
    if t.compile:
        apply_compile(model)
    plain = compiled_loss() if t.compile and not t.loss_chunk_tokens else cross_entropy_sum
    loss = OutputLoss(plain, model, model_config.vocab_size, None, t.loss_chunk_tokens, DTYPES[t.dtype])
    x.requires_grad_(True)
    kernel = expert_kernel(config, model_config, dtype)
    for module in model.modules():  # the experts as the job's runtime runs them (parallel/expert_parallel.py)
        if isinstance(module, MoE):
            module.kernel = ExpertKernel(kernel)
    blocks = {}
    for moe in (False, True):
        layer = first_block(model_config, moe)
        blocks[moe] = timed(lambda m=model.layers[str(layer)]: m(x, cos, sin), (x,)) if layer >= 0 else 0.0
    # the whole model's pass (weights and activations no longer fit a cache as one block's do): the blocks take
    # what the head and embedding leave, shared between the two kinds as measured alone
    tokens = torch.randint(0, model_config.vocab_size, (b, s), device=target, generator=generator)
    whole = timed(lambda: loss(model(tokens, project=loss.project), tokens), ())
    heads, kv_heads, head_dim = model_config.n_heads, model_config.kv_heads, model_config.head_size
    if model_config.attention == "mla":  # the core pads q, k and v to one width (model/mla.py)
        kv_heads = heads
        head_dim = max(model_config.qk_nope_head_dim + model_config.qk_rope_head_dim, model_config.v_head_dim)
    q = torch.randn(b, heads, s, head_dim, device=target, generator=generator, requires_grad=True)
    k = torch.randn(b, kv_heads, s, head_dim, device=target, generator=generator, requires_grad=True)
    v = torch.randn(b, kv_heads, s, head_dim, device=target, generator=generator, requires_grad=True)
    core = timed(lambda: attention_core(q, k, v), (q, k, v))
    labels = torch.randint(0, model_config.vocab_size, (b, s), device=target, generator=generator)
    head = timed(lambda: loss(model.head(x) if loss.project else model.norm(x), labels), (x,))
    alone = sum(blocks[model_config.is_moe_layer(layer)] for layer in range(model_config.n_layers))
    if alone > 0 and whole > head:
        blocks = {moe: seconds * (whole - head) / alone for moe, seconds in blocks.items()}
    return ComputeProfile({key: getattr(model_config, key) for key in MODEL_KEYS}, dtype, b, s, blocks[False],
                          blocks[True], core, head, torch.get_num_threads() if target.type == "cpu" else 0,
                          torch.cuda.get_device_name(target) if target.type == "cuda" else "cpu", t.compile,
                          t.loss_chunk_tokens, kernel)
