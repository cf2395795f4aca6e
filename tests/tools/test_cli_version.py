"""Every command (pyproject.toml's scripts, and launch/pretrain.py) answers --version with megatok's version."""

import importlib
import re
from pathlib import Path

import pytest

from megatok.cli import version
from tests.conftest import ROOT, launch_module

SCRIPTS = re.findall(r'^(megatok-[\w-]+) = "([\w.]+):main"$', (ROOT / "pyproject.toml").read_text(), re.M)


@pytest.mark.parametrize("name,module", SCRIPTS + [("pretrain.py", None)])
def test_every_command_has_version(name, module, capsys):
    main = importlib.import_module(module).main if module else launch_module().main
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.endswith(f"(megatok) {version()}") and version() != "unknown", out
    assert len(SCRIPTS) == 21 and Path(ROOT / "launch/pretrain.py").is_file()


def test_print_config_prints_the_resolved_configuration_and_creates_nothing(tmp_path, capsys):
    import json

    run = tmp_path / "run"
    main = launch_module().main
    assert main(["--config", "configs/tiny.json", "--set", "train.max_steps=7", f"train.run_dir={run}",
                 "--print-config"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["train"]["max_steps"] == 7 and cfg["boundary"]["strategy"] and cfg["train"]["run_dir"] == str(run)
    assert not run.exists()
    assert main(["--config", "configs/tiny.json", "--set", "train.max_stepz=7", "--print-config"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ") and "max_stepz" in line
