"""megatok-generate on a trained checkpoint: seeded samples repeat, chunks are marked, bad input is
one line."""

import base64
import json

import pytest

from tests.conftest import run_main, run_tool

pytestmark = pytest.mark.dist  # runs the real trainer


def samples(*args):
    r = run_tool("generate", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_seeded_samples_repeat_and_chunks_are_marked(tiny_run, capsys):
    common = ["--run", tiny_run, "--prompt", "def main(", "--max-bytes", "40", "--num", "2", "--json"]
    first = [json.loads(line) for line in samples(*common).stdout.splitlines()]
    again = [json.loads(line) for line in samples(*common).stdout.splitlines()]
    assert first == again and len(first) == 2
    assert [s["seed"] for s in first] == [0, 1] and first[0]["text"] != first[1]["text"]
    for s in first:
        assert s["prompt"] == "def main(" and (s["bytes"] == 40 or s["stopped"]) and s["bits_per_byte"] > 0
        assert all(0 <= i < s["bytes"] for i in s["chunk_starts"])

    r = run_main(capsys, "generate", "--run", tiny_run, "--prompt", "Hello, world", "--max-bytes", "30", "--chunks",
                 "--sep", "|", "--boundary", "threshold", "--temperature", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    shown = r.stdout
    assert shown.startswith("== sample 1 (seed 0): ") and "bits/byte" in shown
    assert shown.splitlines()[1].replace("|", "").startswith("Hello, world")


def test_bad_input_is_one_line(tiny_run, tmp_path, capsys):
    r = run_main(capsys, "generate", "--run", tmp_path / "nothing", "--prompt", "x")
    assert r.returncode == 2 and r.stderr.strip().startswith("error:") and len(r.stderr.strip().splitlines()) == 1
    r = run_main(capsys, "generate", "--run", tiny_run, "--temperature", "-1")
    assert r.returncode == 2 and "argument --temperature: must be >= 0" in r.stderr
    r = run_main(capsys, "generate", "--run", tiny_run, "--checkpoint", "step99999999")
    assert r.returncode == 2 and "step99999999" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_sampling_options_as_in_the_python_api(tiny_run, capsys):
    """--top-k 0 is no limit (as top_k=0), --top-p keeps the most likely ids (a tiny p: the argmax alone,
    so temperature 0's samples), --checkpoint (or --tag, as before) picks the checkpoint, and --compile
    gives the same samples."""
    def json_samples(*args):
        r = run_main(capsys, "generate", "--run", tiny_run, "--prompt", "def ", "--max-bytes", "24", "--num", "2",
                     "--json", *args)
        assert r.returncode == 0, r.stderr[-3000:]
        return [json.loads(line) for line in r.stdout.splitlines()]

    free = json_samples()
    assert json_samples("--top-k", "0") == free and json_samples("--top-p", "1") == free
    greedy = json_samples("--temperature", "0")
    assert json_samples("--top-p", "1e-6") == greedy != free
    tag = (tiny_run / "checkpoints" / "latest").read_text().strip()
    assert json_samples("--checkpoint", tag) == free == json_samples("--tag", tag)
    assert json_samples("--compile") == free  # the step through torch.compile (a compile: seconds)
    for flags, message in ((["--compile", "--no-cache"], "--compile runs the cached step: not with --no-cache"),
                           (["--compile", "--cuda-graph"], "--cuda-graph and --compile are two ways to run the step")):
        r = run_main(capsys, "generate", "--run", tiny_run, *flags)
        assert r.returncode == 2 and message in r.stderr


def test_a_prompt_that_is_not_utf8_is_used_byte_for_byte(tiny_run, tmp_path):
    """A shell passes any bytes as an argument: Python hands them over as surrogates, which the tool turns
    back into those bytes, exactly as --prompt-file reads them."""
    raw = b"caf\xe9 \xff("
    (tmp_path / "prompt").write_bytes(raw)
    common = ["--run", tiny_run, "--max-bytes", "20", "--json", "--temperature", "0"]
    given = samples(*common, "--prompt", raw.decode("utf-8", "surrogateescape")).stdout
    assert given == samples(*common, "--prompt-file", tmp_path / "prompt").stdout
    (row,) = map(json.loads, given.splitlines())
    assert base64.b64decode(row["prompt_base64"]) == raw and row["prompt"] == raw.decode("utf-8", "replace")
    text = base64.b64decode(row["text_base64"])  # exactly the sampled bytes, which chunk_starts index
    assert len(text) == row["bytes"] and text.decode("utf-8", "replace") == row["text"]


#: A byte model's export: weights, megatok's config and provenance, the model card, and transformers' files and code.
EXPORT_FILES = sorted(["export.json", "megatok.json", "model.safetensors", "README.md", "config.json",
                       "generation_config.json", "tokenizer_config.json", "configuration_megatok.py",
                       "modeling_megatok.py", "tokenization_megatok.py"])


def test_export_replaces_only_an_earlier_export(tiny_run, tmp_path, capsys):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "keep.txt").write_text("mine")
    r = run_main(capsys, "export", "--run", tiny_run, "--out", notes)
    assert r.returncode == 2 and r.stderr.strip() == (f"error: {notes}: exists and is not a megatok export (no "
                                                      f"export.json, model.safetensors and megatok.json); choose "
                                                      f"another --out or remove it")
    (notes / "export.json").write_text("{}")  # a file of that name alone does not make it an export
    assert run_main(capsys, "export", "--run", tiny_run, "--out", notes).returncode == 2
    assert (notes / "keep.txt").read_text() == "mine"
    (tmp_path / "afile").write_text("x")
    r = run_main(capsys, "export", "--run", tiny_run, "--out", tmp_path / "afile")
    assert r.returncode == 2 and "afile: exists and is not a directory" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "notes"]  # no partial export left behind
    out = tmp_path / "export"
    for _ in range(2):  # an earlier export is replaced
        r = run_main(capsys, "export", "--run", tiny_run, "--out", out)
        assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "export", "notes"]
    assert sorted(p.name for p in out.iterdir()) == EXPORT_FILES
    here = tmp_path / "here"  # --out . in an empty directory fills it (the same directory, not a new one)
    here.mkdir()
    inode = here.stat().st_ino
    r = run_tool("export", "--run", tiny_run, "--out", ".", cwd=here)  # a process, in that directory
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in here.iterdir()) == EXPORT_FILES
    assert here.stat().st_ino == inode and sorted(p.name for p in tmp_path.iterdir()) == [
        "afile", "export", "here", "notes"]
