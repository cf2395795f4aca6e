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


@pytest.mark.parametrize("name,module", SCRIPTS)
def test_every_help_gives_the_defaults_and_one_device_rule(name, module, capsys, monkeypatch):
    """--help gives every option's default (where it has one); --device, where a command has it, defaults to
    cuda when the machine has one."""
    import argparse

    from megatok.cli import CommandParser

    shown = []
    format_help = CommandParser.format_help
    monkeypatch.setattr(CommandParser, "format_help", lambda self: shown.append(self) or format_help(self))
    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    (parser,) = shown
    for action in parser._actions:
        if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS):
            assert "default" in (action.help or "").lower(), (name, action.option_strings)
        if "--device" in action.option_strings:
            assert "cuda when this machine has one, else cpu" in text, name
    if name == "megatok-export":  # an option whose own help says nothing of its default
        assert "--dtype {fp32,bf16,fp16} default: fp32" in text


def test_the_old_spellings_are_aliases(tmp_path, capsys):
    from megatok.cli import lm_eval, model_size

    for argv in (["--model", str(tmp_path / "none"), "--tasks", "x", "--output", str(tmp_path / "o.json")],
                 ["--run", str(tmp_path / "none"), "--tasks", "x", "--out", str(tmp_path / "o.json")]):
        assert lm_eval.main(argv) == 2  # the directory is missing: one error line, whichever spelling
        assert "none" in capsys.readouterr().err.strip().splitlines()[-1]
    for flag in ("--tag", "--checkpoint"):
        with pytest.raises(SystemExit):
            model_size.main(["--config", "configs/tiny.json", flag, "step1"])
        assert capsys.readouterr().err.strip().endswith("--checkpoint goes with --run")
