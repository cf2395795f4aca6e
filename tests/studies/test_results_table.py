"""README.md's results block is what the committed results files give (megatok.studies.results_table), and a
figure changed by hand in it fails the check with the line that differs."""

from megatok.studies import results_table
from tests.conftest import ROOT


def test_the_readme_results_are_the_datas(tmp_path, capsys):
    assert results_table.main(["--check", str(ROOT / "README.md")]) == 0, capsys.readouterr().err
    text = (ROOT / "README.md").read_text()
    block = text.split(results_table.BEGIN, 1)[1].split(results_table.END, 1)[0]
    assert "| policy, megatok's default | 20/20 |" in block  # the table is there, with the data's counts
    edited = tmp_path / "README.md"
    edited.write_text(text.replace("| policy, megatok's default | 20/20 |", "| policy, megatok's default | 19/20 |"))
    assert results_table.main(["--check", str(edited)]) == 1
    err = capsys.readouterr().err
    assert "19/20" in err and "--write" in err
    assert results_table.main(["--write", str(edited)]) == 0 and edited.read_text() == text
    (tmp_path / "bare.md").write_text("no block\n")
    assert results_table.main(["--check", str(tmp_path / "bare.md")]) == 2


def test_the_replication_map_is_the_datas(tmp_path, capsys):
    """docs/replication/README.md's map (seeds aligned per method and level, the probe's value, the fits, the
    oracle, the cost) is generated from control/results.json and the files beside it: a count edited by hand
    fails the check."""
    path = ROOT / "docs/replication/README.md"
    assert results_table.main(["--check", str(path)]) == 0, capsys.readouterr().err
    text = path.read_text()
    block = text.split(results_table.MAP_BEGIN, 1)[1].split(results_table.MAP_END, 1)[0]
    row = next(line for line in block.splitlines() if line.startswith("| `policy` (the default): seeds aligned"))
    assert row.endswith("| 20/20 |") and "r50 0.233" in block
    edited = tmp_path / "README.md"
    edited.write_text(text.replace(row, row.replace("| 20/20 |", "| 19/20 |")))
    assert results_table.main(["--check", str(edited)]) == 1 and "19/20" in capsys.readouterr().err


def test_seed_ranges():
    assert results_table.seed_ranges([4, 0, 1, 2, 100, 101, 7]) == "0-2, 4, 7, 100-101"


def test_the_answer_at_a_glance_is_the_datas(tmp_path, capsys):
    """docs/replication/README.md's answer at a glance (the control's reliability and threshold, prose at
    cpu-small) is generated too: a figure edited by hand fails the check."""
    path = ROOT / "docs/replication/README.md"
    text = path.read_text()
    block = text.split(results_table.GLANCE_BEGIN, 1)[1].split(results_table.GLANCE_END, 1)[0]
    assert "default policy 20/20 at the strongest level" in block and "BPE at the same FLOPs 2.706" in block
    edited = tmp_path / "README.md"
    edited.write_text(text.replace("BPE at the same FLOPs 2.706", "BPE at the same FLOPs 2.607"))
    assert results_table.main(["--check", str(edited)]) == 1 and "2.607" in capsys.readouterr().err
