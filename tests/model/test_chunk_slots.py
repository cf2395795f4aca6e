"""The main network's length K (megatok.model.chunking.chunk_slots): rounded up to a few sizes, the pad
chunks change no output; a capacity caps it (and bounds memory when the boundaries drift toward every
byte), a static one is known without reading the starts (no host sync), and a row with more starts
than that stays causal."""

import torch

from megatok.model.chunking import bucket, chunk_slots, downsample, upsample
from megatok.vocab import PAD
from tests.model.test_causality import make_model


def test_buckets_cover_the_count_with_little_padding_and_few_sizes():
    sizes = [bucket(n) for n in range(1, 5000)]
    assert all(b >= n for n, b in zip(range(1, 5000), sizes))
    assert all(b <= max(64, 1.125 * n) for n, b in zip(range(1, 5000), sizes))
    for lo in (64, 128, 256, 512, 1024, 2048):  # 8 sizes per octave
        assert len({bucket(n) for n in range(lo + 1, 2 * lo + 1)}) == 8
    starts = torch.zeros(3, 300, dtype=torch.bool)
    starts[:, ::4] = True
    starts[1, 1::4] = True  # 150 starts in row 1
    assert chunk_slots(starts) == bucket(150) == 160


def test_a_capacity_needs_no_look_at_the_starts():
    meta = torch.empty(2, 1000, dtype=torch.bool, device="meta")  # no data to read: a sync would fail
    assert chunk_slots(meta, capacity=0.25) == bucket(250) == 256
    assert chunk_slots(torch.ones(1, 10, dtype=torch.bool), capacity=0.9) == 10  # never more than T


def test_pad_chunks_change_nothing(monkeypatch):
    """The same model with K = the largest count (a CPU's), its bucket (a GPU's) and T (static capacity 1),
    the main network skipping the pads or not: the same outputs."""
    import functools

    from megatok.model import chunking, unet

    model = make_model("policy")
    x = torch.randint(0, 256, (3, 70), generator=torch.Generator().manual_seed(0))
    x[1, 40:] = PAD  # a shorter row: fewer chunks
    outs = []
    with torch.no_grad():
        for layout, capacity in [(chunking.chunk_layout, None), (functools.partial(chunking.chunk_layout, bucketed=True),
                                                                 None), (chunking.chunk_layout, 1.0)]:
            monkeypatch.setattr(unet, "chunk_layout", layout)
            model.chunk_capacity = model.static_chunks = capacity
            torch.manual_seed(0)
            outs.append(model(x))
        model.chunk_capacity, model.static_chunks = None, False
        assert int(outs[0].boundaries.starts.sum(1).max()) < 70  # capacity 1: K = 70, pad chunks in every row
        assert chunking.chunk_layout(outs[0].boundaries.starts)[1] is not None  # the first skipped the pads
    for out in outs[1:]:
        assert torch.equal(out.boundaries.starts, outs[0].boundaries.starts)
        torch.testing.assert_close(out.logits, outs[0].logits, rtol=0, atol=1e-5)


def test_past_the_capacity_later_starts_join_the_chunk_before_and_stay_causal():
    starts = torch.tensor([[1, 0, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    h = torch.arange(8.0).view(1, 8, 1)
    chunks, pos, real = downsample(h, starts, 3)
    assert pos.tolist() == [[0, 2, 3]] and real.all()
    assert upsample(chunks, starts)[0, :, 0].tolist() == [0, 0, 2, 3, 3, 3, 3, 3]
    model = make_model("policy")
    model.chunk_capacity = 0.05  # 8 chunks for 100 bytes: most rows have more starts
    x = torch.randint(0, 256, (2, 100))
    with torch.no_grad():
        base = model(x)
        assert base.boundaries.starts.sum(1).min() > 8
        t = 60
        x2 = x.clone()
        x2[:, t + 1:] = torch.randint(0, 256, x2[:, t + 1:].shape)
        out = model(x2, starts=base.boundaries.starts)
    torch.testing.assert_close(out.logits[:, :t + 1], base.logits[:, :t + 1], rtol=0, atol=1e-5)
    assert not torch.allclose(out.logits[:, t + 1:], base.logits[:, t + 1:])


def test_the_main_networks_row_wise_layers_skip_the_pads():
    """chunk_layout lists the real chunks when the pads are more than 5% of the rows; a stack run on those
    rows only gives the real positions what the whole stack gives them, values and gradients."""
    from megatok.model.blocks import Stack
    from megatok.model.chunking import chunk_layout

    starts = torch.zeros(3, 40, dtype=torch.bool)
    starts[0, ::4], starts[1, ::8], starts[2, ::5] = True, True, True  # 10, 5 and 8 chunks
    assert chunk_layout(starts)[0] == 10  # on a CPU: the largest count
    K, rows = chunk_layout(starts, bucketed=True)  # on a GPU: its bucket
    assert K == 16 and rows.tolist() == [*range(10), *range(16, 21), *range(32, 40)]
    few = torch.zeros(1, 100, dtype=torch.bool)
    few[0, :62] = True
    assert chunk_layout(few, bucketed=True) == (64, None)  # 2 pads in 64: all rows
    assert chunk_layout(torch.ones(2, 16, dtype=torch.bool)) == (16, None)  # no pads
    assert chunk_layout(starts, capacity=0.2, static=True) == (8, None)  # a static capacity: no sync, no rows
    K8, rows8 = chunk_layout(starts, capacity=0.2)  # a capacity caps K; rows past it keep their first 8
    assert K8 == 8 and rows8.tolist() == [*range(8), *range(8, 13), *range(16, 24)]
    assert chunk_layout(starts, capacity=0.5)[0] == 10  # a capacity above the largest count: that count
    torch.manual_seed(0)
    stack = Stack(2, 16, 2, 48, eps=1e-5, theta=10000.0)
    x = torch.randn(3, K, 16, requires_grad=True)
    real = torch.zeros(3 * K, dtype=torch.bool)
    real[rows] = True
    real = real.view(3, K)
    whole = stack(x, torch.arange(K))
    (gw,) = torch.autograd.grad(whole[real].square().sum(), x)
    packed = stack(x, torch.arange(K), rows=rows)
    (gp,) = torch.autograd.grad(packed[real].square().sum(), x)
    torch.testing.assert_close(packed[real], whole[real], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gp, gw, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(packed[~real], whole[~real])  # the pads did go another way


def test_a_capacity_bounds_the_main_network_when_the_policy_starts_a_chunk_at_every_byte():
    """A policy drifting toward every byte runs the main network at byte rate, and its activations grow
    with it. With model.chunk_capacity the main network's length stays at the capacity's (the length
    megatok-model-size sizes memory at: sizing.max_chunk_rate), and so does what autograd keeps for the
    backward; without one it follows the policy."""
    from megatok import sizing
    from megatok.config import load_config
    from megatok.model.unet import ByteUNet

    sets = ["model.d_model=32", "model.n_heads=2", "model.n_main_layers=8", "data.seq_len=256"]

    def run(capacity, drift):
        cfg = load_config(None, sets + [f"model.chunk_capacity={capacity}"], world_size=1)
        torch.manual_seed(0)
        model = ByteUNet(cfg.model, cfg.boundary).train()
        if drift:
            with torch.no_grad():
                model.boundary.head.bias.fill_(50.0)  # p = sigmoid(logit_cap): a start at nearly every byte
        x = torch.randint(0, 256, (2, 257), generator=torch.Generator().manual_seed(0))
        lengths, kept = [], []
        hook = model.main.register_forward_pre_hook(lambda m, args: lengths.append(args[0].shape[1]))

        def keep(t):
            kept.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = model(x[:, :-1], x[:, 1:])
        hook.remove()
        return cfg, lengths[0], sum(kept), float(out.boundaries.starts.float().mean())

    _, k_free, free, rate_free = run("null", drift=True)
    cfg, k_cap, capped, rate_cap = run(0.25, drift=True)
    _, k_target, target, _ = run("null", drift=False)
    assert rate_free > 0.95 and rate_cap > 0.95  # the policy starts a chunk at nearly every byte either way
    assert k_free == 256 and k_cap == 64 == sizing.max_chunk_rate(cfg) * 256
    assert capped < 0.55 * free  # the main network's activations at the capacity, not at byte rate
    assert k_target < 64 and target < capped  # at the target rate (0.2) less still: the capacity is a ceiling
