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
    label: str = Field("n", description="text (a --set number stays text)")
    pair: tuple[float, float] = Field((0.1, 0.2), strict=False, description="a tuple, read from a JSON list")


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


def test_a_new_file_is_a_new_strategy(every_nth, tmp_path):
    assert every_nth in megatok.boundaries.available()
    sets = ["model.d_model=32", "model.n_heads=2", "model.n_main_layers=1", f"boundary.strategy={every_nth}"]
    cfg = load_config(None, sets + ["boundary.stride=4"], world_size=1)
    assert cfg.boundary.options.model_dump() == {"stride": 4, "label": "n", "pair": (0.1, 0.2)}
    # read strictly like the shipped options, a tuple from a JSON list, a --set number for a text option as text
    given = load_config(None, sets + ["boundary.stride=4e0", "boundary.pair=[0.3,0.4]", "boundary.label=123"],
                        world_size=1)
    assert given.boundary.options.model_dump() == {"stride": 4, "label": "123", "pair": (0.3, 0.4)}
    with pytest.raises(ConfigError, match='boundary.stride: Input should be a valid integer \\(got "4"\\)'):
        load_config(None, sets + ['boundary.stride="4"'], world_size=1)
    given.dump(tmp_path / "config.json")  # as a run writes it; tools and resumes read it back
    assert load_config(tmp_path / "config.json", world_size=1).boundary.options == given.boundary.options
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
