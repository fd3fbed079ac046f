"""Data: built-in text, file checks, the deterministic split, tables, LM batches and windows."""

import bz2
import json

import pytest
import torch

from tformer.data.files import lm_batch, lm_windows, read_table, read_text, split_rows, split_text
from tformer.errors import DataError


def test_hamlet_is_shipped():
    text = read_text("hamlet")
    assert len(text) > 150_000 and "HAMLET" in text and "\r" not in text


def test_split_is_deterministic_and_disjoint():
    text = read_text("hamlet")
    train, val = split_text(text, 0.1)
    assert (train, val) == split_text(text, 0.1)
    assert train + val == text                         # nothing lost, nothing shared
    assert len(val) == len(text) - int(len(text) * 0.9)


def test_split_rows_is_deterministic_and_disjoint():
    rows = list(range(100))
    train, val = split_rows(rows, 0.2, seed=3)
    assert (train, val) == split_rows(rows, 0.2, seed=3)
    assert len(val) == 20 and sorted(train + val) == rows
    assert split_rows(rows, 0.2, seed=4) != (train, val)


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"), (b"", "is empty"), (b"  \n\n", "is empty"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00", "binary"), (b"caf\xe9 au lait", "not UTF-8"),
])
def test_bad_text_files(tmp_path, content, message):
    path = tmp_path / "data.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        read_text(path)


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(DataError, match="not a file"):
        read_text(tmp_path)


def test_tables(tmp_path):
    (tmp_path / "a.csv").write_text('text,label,extra\n"hello, world",pos,1\nbye,neg,2\n', encoding="utf-8")
    (tmp_path / "a.tsv").write_text("text\tlabel\nhello, world\tpos\nbye\tneg\n", encoding="utf-8")
    lines = [json.dumps({"text": "hello, world", "label": "pos"}), "", json.dumps({"text": "bye", "label": "neg"})]
    with bz2.open(tmp_path / "a.jsonl.bz2", "wt", encoding="utf-8") as f:
        f.write("\n".join(lines))
    want = [{"text": "hello, world", "label": "pos"}, {"text": "bye", "label": "neg"}]
    for name in ("a.csv", "a.tsv", "a.jsonl.bz2"):
        assert read_table(tmp_path / name, ["text", "label"]) == want
    with pytest.raises(DataError, match="no column"):
        read_table(tmp_path / "a.csv", ["text", "target"])
    (tmp_path / "b.jsonl").write_text('{"text": 1}\n[1]\n')
    with pytest.raises(DataError, match="JSON object"):
        read_table(tmp_path / "b.jsonl", ["text"])
    (tmp_path / "c.xlsx").write_text("x")
    with pytest.raises(DataError, match="unknown table format"):
        read_table(tmp_path / "c.xlsx", ["text"])


def test_lm_batch_is_a_pure_function_of_seed_and_step():
    tokens = torch.arange(1000)
    x, y = lm_batch(tokens, 4, 16, seed=1, step=7)
    x2, y2 = lm_batch(tokens, 4, 16, seed=1, step=7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, lm_batch(tokens, 4, 16, seed=1, step=8)[0])
    assert not torch.equal(x, lm_batch(tokens, 4, 16, seed=2, step=7)[0])
    assert x.shape == (4, 16)
    assert torch.equal(y, x + 1)                       # targets = inputs shifted by one (tokens = arange)
    assert int(y.max()) < 1000


def test_lm_windows_predict_every_token_once():
    tokens = torch.arange(103)
    windows = lm_windows(tokens, 10)
    assert all(len(x) <= 10 and len(x) == len(y) for x, y in windows)
    assert torch.equal(torch.cat([y for _, y in windows]), tokens[1:])
    assert torch.equal(torch.cat([x for x, _ in windows]), tokens[:-1])
