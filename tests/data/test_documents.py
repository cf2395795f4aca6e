import gzip
import json

import pytest

from megatok.data.documents import DataError, Document, iter_documents, list_input_files, split_text


def write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def test_txt_and_jsonl_with_gzip(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"plain text\n")
    with gzip.open(tmp_path / "b.txt.gz", "wb") as f:
        f.write(b"zipped text")
    write_jsonl(tmp_path / "c.jsonl", [{"text": "caf\u00e9", "lang": "fr", "domain": "web"}, {"text": "second"}])
    write_jsonl(tmp_path / "d.jsonl.gz", [{"text": "gz line", "lang": "es"}], opener=gzip.open)
    paths = [str(tmp_path / n) for n in ("a.txt", "b.txt.gz", "c.jsonl", "d.jsonl.gz")]
    docs = list(iter_documents(paths, lang="en", domain="books"))
    assert docs == [
        Document(b"plain text\n", "en", "books", paths[0]),
        Document(b"zipped text", "en", "books", paths[1]),
        Document("caf\u00e9".encode(), "fr", "web", paths[2] + ":1"),
        Document(b"second", "en", "books", paths[2] + ":2"),  # missing metadata filled from the arguments
        Document(b"gz line", "es", "books", paths[3] + ":1"),
    ]


def test_directory_is_walked_sorted_and_recursively(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "z.txt").write_bytes(b"z")
    (tmp_path / "b.txt").write_bytes(b"b")
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "notes.md").write_bytes(b"ignored inside a directory")
    docs = list(iter_documents([str(tmp_path)]))
    assert [d.text for d in docs] == [b"a", b"b", b"z"]


def test_an_input_reached_twice_is_read_once_and_links_do_not_loop(tmp_path, capsys):
    from megatok.data.documents import list_input_files

    raw = tmp_path / "raw"
    (raw / "sub").mkdir(parents=True)
    (raw / "a.txt").write_bytes(b"a")
    (raw / "sub" / "b.txt").write_bytes(b"b")
    (raw / "sub" / "up").symlink_to("..")  # a loop: raw/sub/up/sub/up/...
    (tmp_path / "alias").symlink_to(raw)
    got = list_input_files([str(raw), str(raw / "a.txt"), str(tmp_path / "alias"), str(raw / "sub" / "up")])
    assert got == [str(raw / "a.txt"), str(raw / "sub" / "b.txt")]
    err = capsys.readouterr().err
    assert err == (f"megatok: warning: 3 input(s) reached twice, read once: {raw / 'a.txt'}, {tmp_path / 'alias'}, "
                   f"{raw / 'sub' / 'up'}\n")
    assert [d.text for d in iter_documents([str(raw), str(raw / "sub")])] == [b"a", b"b"]
    assert capsys.readouterr().err == ""  # iter_documents leaves the warning to the tool's own listing
    (raw / "a.txt").unlink()  # raw holds only sub now: given after it, raw adds nothing and is no error
    assert list_input_files([str(raw / "sub"), str(raw)]) == [str(raw / "sub" / "b.txt")]
    assert "1 input(s) reached twice, read once: " + str(raw) in capsys.readouterr().err


def test_the_tools_readers_read_a_file_reached_twice_once(tmp_path):
    """evaluate, the head-to-head and train_bpe read their paths one by one (megatok.data.inputs); a file
    named twice, inside a directory also given or through a link, is read once, in either split."""
    from megatok.data.inputs import is_shards, read_documents

    (tmp_path / "held").mkdir()
    f = write_jsonl(tmp_path / "held" / "udhr.targets.jsonl", [{"text": "one"}, {"text": "two"}])
    (tmp_path / "link.jsonl").symlink_to(f)
    for paths in ([f, f], [str(tmp_path / "held"), f], [f, str(tmp_path / "link.jsonl")]):
        assert [d.text for d in read_documents(paths, "val")] == [b"one", b"two"], paths
        assert [d.text for d in read_documents(paths, "train")] == [b"one", b"two"], paths
    # a document file whose path says ".tar" is no shard set; tars, patterns and URLs are
    assert not is_shards(f) and not is_shards(str(tmp_path / "x.tar.d" / "a.jsonl"))
    assert all(is_shards(p) for p in ("val-00000.tar", "d/train-{00000..00003}.tar", "pipe:cat x.tar",
                                      "https://host/train-000.tar"))


def test_non_utf8_and_binary_txt_are_bytes(tmp_path):
    latin1 = "na\u00efve \u00e9t\u00e9".encode("latin-1")
    binary = bytes(range(256)) * 3
    (tmp_path / "latin1.txt").write_bytes(latin1)
    (tmp_path / "blob.txt").write_bytes(binary)
    docs = list(iter_documents([str(tmp_path / "latin1.txt"), str(tmp_path / "blob.txt")]))
    assert [d.text for d in docs] == [latin1, binary]


def test_empty_documents_are_skipped_and_counted(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    path = write_jsonl(tmp_path / "x.jsonl", [{"text": ""}, {"text": "kept"}, ""])  # "" = blank line, ignored
    stats = {}
    docs = list(iter_documents([str(tmp_path / "empty.txt"), path], stats=stats))
    assert [d.text for d in docs] == [b"kept"]
    assert stats == {"documents": 1, "bytes": 4, "empty_documents": 2, "split_documents": 0}


def test_long_documents_are_split_at_newlines_without_losing_bytes(tmp_path):
    text = b"line one\nline two\nline three is longer\n" + b"x" * 50
    (tmp_path / "long.txt").write_bytes(text)
    stats = {}
    docs = list(iter_documents([str(tmp_path / "long.txt")], max_doc_bytes=20, stats=stats))
    assert b"".join(d.text for d in docs) == text
    assert all(len(d.text) <= 20 for d in docs)
    assert docs[0].text == b"line one\nline two\n"  # cut after the last newline before the limit
    assert docs[-1].text == b"x" * 10  # no newline: hard cuts at the limit
    assert stats["split_documents"] == 1 and stats["documents"] == len(docs)
    assert [d.source for d in docs] == [f"{tmp_path / 'long.txt'}#{k}" for k in range(len(docs))]


def test_split_text_edges():
    assert split_text(b"abc", 3) == [b"abc"]
    assert split_text(b"abcd", 3) == [b"abc", b"d"]
    assert split_text(b"\nabcdef", 3) == [b"\n", b"abc", b"def"]


def test_missing_path_and_unsupported_file(tmp_path):
    with pytest.raises(DataError, match="nope.txt: no such file"):
        list(iter_documents([str(tmp_path / "nope.txt")]))
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="data.csv: unsupported file type"):
        list_input_files([str(tmp_path / "data.csv")])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="empty_dir: directory contains no"):
        list_input_files([str(tmp_path / "empty_dir")])


@pytest.mark.parametrize("line, problem", [
    ('{"text": "ok"', "invalid JSON"),
    ('["a list"]', "expected a JSON object, got list"),
    ('{"body": "no text"}', 'missing "text" field'),
    ('{"text": 3}', '"text" must be a string, got int'),
    ('{"text": "x", "lang": 5}', '"lang" must be a string'),
])
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, problem):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, line, {"text": "never read"}])
    with pytest.raises(DataError) as info:
        list(iter_documents([path]))
    message = str(info.value)
    assert message.startswith(f"{path}:2: ") and problem in message and "\n" not in message


def test_corrupt_gzip(tmp_path):
    data = gzip.compress(b'{"text": "hello"}\n' * 1000)
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.txt.gz").write_bytes(b"this is not gzip data")
    for name in ("cut.jsonl.gz", "junk.txt.gz"):
        with pytest.raises(DataError, match=f"{name}: corrupt gzip file"):
            list(iter_documents([str(tmp_path / name)]))
