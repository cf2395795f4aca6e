"""tools/quickstart.sh and tools/head_to_head.sh start their ranks on MASTER_PORT when it is set and on a
free port otherwise (the deepspeed launcher's default, 29500, may be held by another job). Each script runs
as written in a copy of the repository's scripts whose .venv holds two recorders: ``python`` runs only
``-c`` (the free-port choice, with the real interpreter) and ``deepspeed`` writes its arguments down; the
corpus, tokenizer and training commands do nothing."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PYTHON_STUB = f"""#!/usr/bin/env bash
if [ "$1" = -c ]; then PYTHONPATH={ROOT} exec {sys.executable} "$@"; fi
exit 0
"""
DEEPSPEED_STUB = """#!/usr/bin/env bash
echo "$@" >> "$(dirname "$0")/deepspeed.calls"
"""


def script_copy(tmp_path):
    """A directory laid out as the repository for the script: tools/, the files tools/setup.sh compares
    with its stamp (so it installs nothing) and the two recorders."""
    (tmp_path / "tools").mkdir()
    for name in ("quickstart.sh", "head_to_head.sh", "setup.sh"):
        shutil.copy(ROOT / "tools" / name, tmp_path / "tools" / name)
    for name in ("requirements.txt", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (tmp_path / ".venv" / ".megatok-requirements").write_bytes(
        (ROOT / "requirements.txt").read_bytes() + (ROOT / "pyproject.toml").read_bytes())
    for name, text in (("python", PYTHON_STUB), ("deepspeed", DEEPSPEED_STUB)):
        (venv / name).write_text(text)
        (venv / name).chmod(0o755)
    return tmp_path


def ports(tmp_path, script: str, **env) -> list[int]:
    """The --master_port of every deepspeed call the script made."""
    run_env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    run_env.update(RUN=str(tmp_path / "run"), OUT=str(tmp_path / "h2h"), **env)
    (tmp_path / "run").mkdir(exist_ok=True)
    r = subprocess.run(["bash", f"tools/{script}"], cwd=tmp_path, env=run_env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    calls = (tmp_path / ".venv/bin/deepspeed.calls").read_text().splitlines()
    (tmp_path / ".venv/bin/deepspeed.calls").unlink()
    out = []
    for call in calls:
        words = call.split()
        assert "launch/pretrain.py" in words and words.index("--master_port") < words.index("launch/pretrain.py")
        out.append(int(words[words.index("--master_port") + 1]))
    return out


@pytest.mark.parametrize("script, runs", [("quickstart.sh", 1), ("head_to_head.sh", 2)])
def test_the_scripts_take_master_port_or_a_free_port(tmp_path, script, runs):
    root = script_copy(tmp_path)
    assert ports(root, script, MASTER_PORT="23456") == [23456] * runs
    with socket.socket() as held:  # the launcher's default port, taken: the scripts go elsewhere
        try:
            held.bind(("", 29500))
        except OSError:
            pass  # taken already, which is the case the scripts must survive
        chosen = ports(root, script)
    assert len(chosen) == runs and 29500 not in chosen and all(10000 <= p < 65536 for p in chosen)
