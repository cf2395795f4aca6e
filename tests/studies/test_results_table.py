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
