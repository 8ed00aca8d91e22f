"""The built-in calibration/validation texts and the user text-file reader (stdlib + pytest only)."""
from __future__ import annotations

import json

import pytest

from mbert.bundle.errors import TextFileError
from mbert.bundle.texts import calibration_texts, load_text_file


# ----------------------------------------------------------------------------- built-in set


def test_calibration_set_is_large_and_varied():
    texts = calibration_texts()
    assert len(texts) >= 20
    assert all(isinstance(t, str) and t.strip() for t in texts)
    words = [len(t.split()) for t in texts]
    assert sum(words) > 15_000
    assert max(words) > 4_000  # beyond 4096 tokens: exercises long-sequence paths
    assert min(words) < 5  # a search query of a couple of words
    assert sum(1 for w in words if 1_500 <= w <= 3_000) >= 3
    assert len(set(texts)) == len(texts)  # no duplicated documents


def test_calibration_set_covers_code_and_non_ascii():
    texts = calibration_texts()
    assert any("def " in t and "return" in t for t in texts)  # Python source
    assert any("#include" in t for t in texts)  # C++
    assert any("SELECT" in t for t in texts)  # SQL
    assert any(any(ord(c) > 127 for c in t) for t in texts)  # accents, symbols
    assert any(t.lstrip().startswith("{") for t in texts)  # JSON


def test_calibration_texts_returns_a_fresh_list():
    first = calibration_texts()
    first.clear()
    assert len(calibration_texts()) >= 20


def test_long_documents_are_not_repetitive():
    # A calibration document built by repeating one paragraph would be a poor one.
    for text in calibration_texts():
        paragraphs = [p.strip() for p in text.split("\n\n") if len(p.split()) >= 30]
        assert len(paragraphs) == len(set(paragraphs))


# ----------------------------------------------------------------------------- user files


def test_load_plain_text_one_per_nonblank_line(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text("first text\n\n   \nsecond — with accents: café\r\nthird\n", encoding="utf-8")
    assert load_text_file(path) == ["first text", "second — with accents: café", "third"]
    assert load_text_file(str(path)) == ["first text", "second — with accents: café", "third"]


def test_load_plain_text_with_bom(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffhello\nworld\n".encode("utf-8"))
    assert load_text_file(path) == ["hello", "world"]


def test_load_jsonl_strings_and_objects(tmp_path):
    path = tmp_path / "calib.jsonl"
    lines = [
        json.dumps("a plain string"),
        "",
        json.dumps({"text": "from an object", "id": 7}),
        json.dumps({"text": "multi\nline"}),
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert load_text_file(path) == ["a plain string", "from an object", "multi\nline"]


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "nope.txt"
    with pytest.raises(TextFileError, match="nope.txt"):
        load_text_file(path)


@pytest.mark.parametrize("name", ["empty.txt", "empty.jsonl"])
def test_empty_file_is_an_error(tmp_path, name):
    path = tmp_path / name
    path.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(TextFileError, match=name.replace(".", r"\.")):
        load_text_file(path)


def test_undecodable_file_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"fine\nalso fine\ncaf\xe9\n")
    with pytest.raises(TextFileError) as info:
        load_text_file(path)
    assert "latin1.txt:3" in str(info.value)


@pytest.mark.parametrize(
    "bad_line",
    [
        "{not json",
        json.dumps({"body": "no text key"}),
        json.dumps({"text": 42}),
        json.dumps(["a", "list"]),
        json.dumps(12),
        json.dumps(""),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, bad_line):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps("ok") + "\n\n" + bad_line + "\n" + json.dumps("ok") + "\n", encoding="utf-8")
    with pytest.raises(TextFileError) as info:
        load_text_file(path)
    assert "bad.jsonl:3" in str(info.value)


def test_text_file_error_is_an_mbert_error(tmp_path):
    from mbert.bundle.errors import MbertError

    with pytest.raises(MbertError):
        load_text_file(tmp_path / "missing.jsonl")
