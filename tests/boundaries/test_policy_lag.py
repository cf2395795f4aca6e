"""The score-function policy's lag option: the decision whether a chunk starts at t reads h_{t-lag}."""

import pytest
import torch

from megatok.boundaries import build_strategy
from megatok.config import ConfigError, load_config


@pytest.mark.parametrize("window", [1, 3])
def test_a_lagged_decision_is_the_published_one_made_on_the_earlier_state(window):
    """lag 2 on h equals lag 0 on h shifted two positions (zeros before the sequence and for two bytes
    after the forced start at 20): the same draws from the same noise, the same probabilities."""
    torch.manual_seed(0)
    h = torch.randn(3, 40, 8)
    mask = torch.ones(3, 40, dtype=torch.bool)
    forced = torch.zeros(3, 40, dtype=torch.bool)
    forced[:, 0] = forced[1, 20] = True
    torch.manual_seed(1)
    lagged = build_strategy("policy", d_model=8, target_rate=0.3, options={"lag": 2, "window": window}).train()
    torch.manual_seed(1)
    plain = build_strategy("policy", d_model=8, target_rate=0.3, options={"window": window}).train()
    with torch.no_grad():
        for s in (lagged, plain):
            s.head.weight.mul_(400.0)  # decisive: p varies with h
    shifted = torch.zeros_like(h)
    shifted[:, 2:] = h[:, :-2]
    shifted[1, 20:22] = 0.0
    torch.manual_seed(2)
    a = lagged(h, None, mask, forced)
    torch.manual_seed(2)
    b = plain(shifted, None, mask, forced)
    assert torch.equal(a.starts, b.starts) and 0 < a.starts[:, 1:].float().mean() < 0.9
    torch.testing.assert_close(a.probs, b.probs)
    torch.testing.assert_close(a.log_probs, b.log_probs)
    # and the state at t itself is not read: changing h at t moves only later decisions' p
    h2 = h.clone()
    h2[:, 10] += 5.0
    torch.manual_seed(2)
    c = lagged(h2, None, mask, forced)
    assert torch.equal(c.probs[:, :12], a.probs[:, :12]) and not torch.allclose(c.probs[:, 12], a.probs[:, 12])


def test_lag_is_checked_when_the_config_loads():
    cfg = load_config("configs/tiny.json", ["boundary.strategy=policy", "boundary.lag=1"], world_size=1)
    assert cfg.boundary.options.lag == 1
    with pytest.raises(ConfigError, match="boundary.lag"):
        load_config("configs/tiny.json", ["boundary.strategy=policy", "boundary.lag=-1"], world_size=1)
