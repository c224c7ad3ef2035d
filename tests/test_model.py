"""The plain model: shapes, attention variants, causality, init, meta-device build, KV cache."""

import pytest
import torch

from fivefold.model import KVCache, ModelConfig, build_model, materialize
from fivefold.model.generate import generate
from fivefold.model.llama import apply_rope, rope_tables

from conftest import micro_model


def make(**changes):
    return materialize(build_model(micro_model(vocab_size=50, **changes)), "cpu", seed=3)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_attention_variants_shapes_and_params(kv_heads):
    model = make(n_kv_heads=kv_heads)
    assert model.layers["0"].attention.wk.weight.shape == (kv_heads * 8, 32)
    logits = model(torch.randint(0, 50, (2, 10)))
    assert logits.shape == (2, 10, 50)
    assert torch.isfinite(logits).all()


def test_built_on_meta_without_memory():
    model = build_model(micro_model(vocab_size=50))
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.rope_cos.device.type == "meta"


def test_a_block_built_alone_has_unit_norms():
    """A block made outside a model (plan/ring_host.py times one, plan/operators.py counts one) is a valid block:
    its RMSNorm weights start at one as init_weights sets them, not as uninitialised memory (which held values
    from 1e-10 to 1e38 here, and a block built so took 60-770 ms a pass at 4 x 128 tokens against 18-25 ms)."""
    from fivefold.model.llama import TransformerBlock

    block = TransformerBlock(micro_model(), 0)
    norms = {name: p for name, p in block.named_parameters() if name.endswith("norm.weight")}
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms.values())


def test_causal_future_tokens_do_not_change_past_logits():
    model = make()
    tokens = torch.randint(0, 50, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 50
    assert torch.equal(model(tokens)[:, :8], model(changed)[:, :8])
    assert not torch.allclose(model(tokens)[:, 8:], model(changed)[:, 8:])


def test_init_depends_only_on_seed_and_name():
    a, b, c = make(), make(), materialize(build_model(micro_model(vocab_size=50)), "cpu", seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb)
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc)
    # A model with fewer layers draws identical values for the layers it shares.
    shallow = materialize(build_model(micro_model(vocab_size=50, n_layers=1)), "cpu", seed=3)
    assert torch.equal(shallow.layers["0"].attention.wq.weight, a.layers["0"].attention.wq.weight)


def test_init_statistics_follow_llama_neox():
    model = materialize(build_model(micro_model(vocab_size=500, dim=128, n_heads=4)), "cpu", seed=0)
    std = model.config.init_std
    assert model.layers["0"].attention.wq.weight.std().item() == pytest.approx(std, rel=0.05)
    assert model.layers["0"].feed_forward.w2.weight.std().item() == pytest.approx(std / 2.0, rel=0.05)  # sqrt(2 * 2 layers)
    assert torch.all(model.norm.weight == 1)


def test_tied_embeddings_share_one_tensor():
    model = make(tie_embeddings=True)
    assert model.output is None
    assert "output.weight" not in model.state_dict()
    h = torch.randn(1, 3, 32)
    assert torch.allclose(torch.nn.functional.linear(h, model.tok_embeddings.weight), h @ model.tok_embeddings.weight.T)
    model(torch.randint(0, 50, (1, 5))).sum().backward()
    assert model.tok_embeddings.weight.grad is not None


def test_rope_is_a_rotation_and_relative():
    cos, sin = rope_tables(ModelConfig(dim=8, n_heads=1, max_seq_len=32, rope_theta=10000.0))
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    rotated = apply_rope(q, cos[5], sin[5])
    assert torch.allclose(rotated.norm(), q.norm(), atol=1e-6)
    dot = lambda i, j: (apply_rope(q, cos[i], sin[i]) * apply_rope(k, cos[j], sin[j])).sum()  # noqa: E731
    assert torch.allclose(dot(7, 3), dot(14, 10), atol=1e-5)


def test_rope_theta_changes_the_model():
    tokens = torch.randint(0, 50, (1, 16))
    assert not torch.allclose(make()(tokens), make(rope_theta=500.0)(tokens))


def test_kv_cache_matches_full_recompute():
    model = make().eval()
    tokens = torch.randint(0, 50, (2, 20))
    full = model(tokens)
    cache = KVCache(model.config, 2, 20, "cpu", torch.float32)
    pieces = [model(tokens[:, :8], cache=cache)] + [model(tokens[:, i : i + 1], cache=cache) for i in range(8, 12)]
    pieces.append(model(tokens[:, 12:], cache=cache))  # several new positions at once
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5)


def test_generate_with_cache_equals_without():
    model = make().eval()
    prompt = [1, 2, 3, 4]
    assert generate(model, prompt, 15, use_cache=True) == generate(model, prompt, 15, use_cache=False)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    sampled = generate(model, prompt, 15, temperature=1.0, top_k=5, generator=g1, use_cache=True)
    assert sampled == generate(model, prompt, 15, temperature=1.0, top_k=5, generator=g2, use_cache=False)


def test_generate_stops_at_max_seq_len():
    model = make(max_seq_len=16).eval()
    assert len(generate(model, [1, 2, 3], 100)) == 13
