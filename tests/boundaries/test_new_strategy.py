"""The README's promise: a new boundary strategy is one new file and a config value, nothing else.
A strategy written into a directory on the package's search path is found by name, its options are
validated like the shipped ones, and the model runs and backpropagates with it."""

import pytest
import torch

import megatok.boundaries
from megatok.config import ConfigError, load_config
from megatok.model.unet import ByteUNet

STRATEGY = '''
from pydantic import BaseModel, ConfigDict, Field

from megatok.boundaries.base import Boundaries, BoundaryStrategy, finalize_starts


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    stride: int = Field(3, gt=0, description="a chunk starts every stride bytes")


class Strategy(BoundaryStrategy):
    def forward(self, h, x, mask, forced):
        t = torch.arange(x.shape[1], device=x.device)
        return Boundaries(starts=finalize_starts((t % self.options.stride == 0).expand_as(mask), mask, forced))
'''


@pytest.fixture
def every_nth(tmp_path, monkeypatch):
    (tmp_path / "every_nth.py").write_text("import torch\n" + STRATEGY)
    monkeypatch.setattr(megatok.boundaries, "__path__", [*megatok.boundaries.__path__, str(tmp_path)])
    yield "every_nth"


def test_a_new_file_is_a_new_strategy(every_nth):
    assert every_nth in megatok.boundaries.available()
    sets = ["model.d_model=32", "model.n_heads=2", "model.n_main_layers=1", f"boundary.strategy={every_nth}"]
    cfg = load_config(None, sets + ["boundary.stride=4"], world_size=1)
    assert cfg.boundary.options == {"stride": 4}
    with pytest.raises(ConfigError, match="boundary.strid: unknown key for strategy 'every_nth'.*boundary.stride"):
        load_config(None, sets + ["boundary.strid=4"], world_size=1)
    with pytest.raises(ConfigError, match="boundary.stride: Input should be greater than 0"):
        load_config(None, sets + ["boundary.stride=0"], world_size=1)

    torch.manual_seed(0)
    model = ByteUNet(cfg.model, cfg.boundary)
    x = torch.randint(0, 256, (2, 24))
    out = model(x)
    assert out.boundaries.starts[0].nonzero().flatten().tolist() == [0, 4, 8, 12, 16, 20]
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
    loss.backward()
    assert all(p.grad is not None for p in model.main.parameters())
