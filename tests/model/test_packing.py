"""The packed layout (model.pack_chunks; megatok.model.chunking.pack): with room for every start, the loss and
every gradient are the [rows, chunks] layout's, for every strategy; past its length it drops each row's last
starts first, deterministically, keeps every row's first, counts what it dropped, and the policy's
log-probabilities are those of the decisions taken; no host read."""

import pytest
import torch

from megatok.model.chunking import pack, packed_length
from megatok.vocab import PAD, SEP
from tests.model.test_causality import make_model

CASES = ["policy", "policy-window3", "policy-lag1", "hnet", "gumbel", "fixed", "uniform", "whitespace"]


def batch(seed=0, B=3, T=80):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (B, T + 1), generator=g)
    x[:, ::7] = 32  # spaces, for whitespace
    x[1, 50:] = PAD  # a short row
    x[2, 30] = SEP  # two documents in a row
    return x[:, :-1], x[:, 1:]


@pytest.mark.parametrize("strategy", CASES)
@pytest.mark.parametrize("documents", [False, True])
def test_with_room_for_every_start_the_loss_and_gradients_are_the_row_layouts(strategy, documents):
    model = make_model(strategy, document_mask=str(documents).lower()).train()
    x, y = batch()
    outs, grads = [], []
    for slack in (None, 8.0):
        model.pack_slack = slack
        model.zero_grad()
        torch.manual_seed(0)
        out = model(x, y)
        out.loss.backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (a, b), (ga, gb) = outs, grads
    assert torch.equal(a.boundaries.starts, b.boundaries.starts) and int(b.boundaries.dropped.sum()) == 0
    torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=2e-5)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-7)
    assert sorted(ga) == sorted(gb)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-4, atol=1e-6, msg=name)
    assert b.rows["dropped_starts"].sum() == 0


def test_past_its_length_each_rows_last_starts_go_first():
    starts = torch.zeros(3, 10, dtype=torch.bool)
    starts[:, 0] = True
    starts[0, [2, 4, 6, 8]] = True  # row 0: 5 starts
    starts[1, [5]] = True  # row 1: 2
    starts[2, [1, 9]] = True  # row 2: 3, its t = 9 a document's (forced)
    forced = torch.zeros_like(starts)
    forced[:, 0] = True
    forced[2, 9] = True
    lay = pack(starts, forced, 7)
    # kept: the forced (4), then each row's 2nd start (rows 0, 1, 2): 7; row 0 loses its 3rd to 5th
    assert lay.starts[0].nonzero().flatten().tolist() == [0, 2]
    assert lay.starts[1].nonzero().flatten().tolist() == [0, 5]
    assert lay.starts[2].nonzero().flatten().tolist() == [0, 1, 9]
    assert lay.dropped.tolist() == [3, 0, 0]
    assert lay.src.tolist() == [0, 2, 10, 15, 20, 21, 29]
    assert lay.positions.tolist() == [0, 2, 0, 5, 0, 1, 9]
    assert lay.chunk_of.view(3, 10)[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]  # bytes of dropped starts: chunk before
    assert len(set(lay.segments.tolist())) == 3  # one segment a row (no documents given)
    lay = pack(starts, forced, 10)  # room for all 10
    assert int(lay.dropped.sum()) == 0 and torch.equal(lay.starts, starts) and len(set(lay.segments.tolist())) == 3
    lay = pack(starts, forced, 12)  # room to spare: the slots past the real ones each a segment of its own
    assert len(set(lay.segments.tolist())) == 5 and lay.chunk_of.max() == 9
    assert packed_length(16, 256, 0.2, 1.1) == 960 and packed_length(1, 8, 0.5, 8) == 8


def test_the_policy_is_credited_with_the_decisions_taken():
    model = make_model("policy").train()
    model.pack_slack = 1.0
    model.boundary.target_rate = 0.05  # a packed length far below the starts drawn at p ~ 0.5
    x, y = batch()
    torch.manual_seed(0)
    out = model(x, y)
    b = out.boundaries
    assert int(b.dropped.sum()) > 0 and out.rows["dropped_starts"].sum() == b.dropped.sum()
    logits = b.extra["logits"]
    want = torch.where(b.starts, torch.nn.functional.logsigmoid(logits), torch.nn.functional.logsigmoid(-logits))
    torch.testing.assert_close(b.log_probs, want)
    assert b.starts[:, 0].all() and int(b.starts.sum()) <= packed_length(3, 80, 0.05, 1.0)
    out.loss.backward()  # the dropped decisions are in the estimator's terms as taken


def test_no_host_read(monkeypatch):
    """The packed main network reads nothing back to the host: every .item()/.tolist()/bool() of a tensor
    inside the model's forward fails."""
    model = make_model("policy").train()
    model.pack_slack = 1.5
    x, y = batch()
    calls = []
    for name in ("item", "tolist", "__bool__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: calls.append(_n) or _o(self, *a, **k))
    from megatok.model import unet

    monkeypatch.setattr(unet, "chunk_layout", lambda *a, **k: pytest.fail("the row layout was used"))
    calls.clear()
    model(x, y)
    assert calls == []
