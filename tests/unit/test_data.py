import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlkit.errors import RlkitError
from rlkit.io import data
from rlkit.tiny import build_tokenizer


def test_token_batches_respect_budget_and_cover_everything():
    rng = random.Random(0)
    lengths = [rng.randint(3, 40) for _ in range(500)]
    for r in (None, random.Random(1)):
        batches = data.token_batches(lengths, 256, r)
        assert sorted(i for b in batches for i in b) == list(range(500))
        for b in batches:
            assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 256


def test_sft_labels_mask_prompt_and_padding():
    tok = build_tokenizer()
    pids = data.encode_prompts(tok, ["<1+2>=", "<10+20+3>="], chat=False)
    ids, plens, truncated = data.encode_sft(tok, pids, ["3", "33"], max_len=64)
    assert truncated == 0 and plens == [len(p) for p in pids]
    assert ids[0] == [tok.bos_token_id, *tok("<1+2>=3", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    input_ids, mask, labels = data.collate_sft(ids, plens, tok.pad_token_id)
    assert input_ids.shape == labels.shape == mask.shape == (2, len(ids[1]))
    # row 0: only "3" and eos are learned; padding is masked and ignored
    learned = labels[0][labels[0] != data.IGNORE].tolist()
    assert tok.decode(learned[:-1]) == "3" and learned[-1] == tok.eos_token_id
    assert mask[0].sum() == len(ids[0]) and (labels[0, len(ids[0]):] == data.IGNORE).all()


def test_too_long_examples_are_truncated_and_counted():
    tok = build_tokenizer()
    pids = data.encode_prompts(tok, ["<1+2>="], chat=False)
    ids, _, truncated = data.encode_sft(tok, pids, ["3" * 50], max_len=20)
    assert truncated == 1 and len(ids[0]) == 20


def test_sources_from_jsonl_and_parquet_with_column_mapping(tmp_path):
    rows = [{"question": f"<{i}+1>=", "gold": i + 1} for i in range(5)]
    j = tmp_path / "q.jsonl"
    j.write_text("\n".join(json.dumps(r) for r in rows))
    src = data.load_source(str(j), "prompts", {"prompt": "question", "answer": "gold"})
    assert src.table.column("prompt").to_pylist()[0] == "<0+1>="
    assert src.table.column("answer").to_pylist()[4] == "5"  # ints become strings
    assert src.table.column("prompt_id").to_pylist()[0] == "q-0"
    pq.write_table(pa.table({"prompt": ["a", "b"], "completion": ["1", "2"]}), tmp_path / "s.parquet")
    s = data.load_source(str(tmp_path / "s.parquet"), "sft", {"prompt": "prompt", "completion": "completion"})
    assert s.table.num_rows == 2 and not s.chat


def test_source_errors_are_one_clear_line(tmp_path):
    with pytest.raises(RlkitError, match="no such file"):
        data.load_source(str(tmp_path / "nope.jsonl"), "prompts", {})
    j = tmp_path / "q.jsonl"
    j.write_text(json.dumps({"question": "x"}))
    with pytest.raises(RlkitError, match="no column 'text'"):
        data.load_source(str(j), "prompts", {"prompt": "text"})
    with pytest.raises(RlkitError, match="missing column 'prompt'"):
        data.load_source(str(j), "prompts", {})
    (tmp_path / "x.txt").write_text("a,b")
    with pytest.raises(RlkitError, match="unsupported data file type"):
        data.load_source(str(tmp_path / "x.txt"), "prompts", {})


def test_messages_go_through_the_chat_template(tmp_path):
    j = tmp_path / "chat.jsonl"
    msgs = [{"role": "user", "content": "<1+1>="}, {"role": "assistant", "content": "2"}]
    j.write_text(json.dumps({"messages": msgs}))
    src = data.load_source(str(j), "sft", {})
    assert src.chat and src.table.column("completion").to_pylist() == ["2"]
    tok = build_tokenizer()
    with pytest.raises(RlkitError, match="no chat template"):
        data.render_prompts(tok, src, for_sft=True)
    tok.chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    assert data.render_prompts(tok, src, for_sft=True) == ["[user]<1+1>=[assistant]"]



def _parquet(rows: int) -> bytes:
    import io

    buf = io.BytesIO()
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(rows)]}), buf)
    return buf.getvalue()


_BINARY = bytes(range(256)) * 8  # not UTF-8 from its 129th byte on (line 1: it holds one newline, byte 10)
# (file name, its bytes, what the one error line says besides the file's path)
DAMAGED = [
    ("empty.jsonl", b"", "is empty: expected one JSON object a line"),
    ("blank.jsonl", b"  \n\n\t\n", "is empty: expected one JSON object a line"),
    ("empty.json", b"", "is empty: expected JSON objects"),
    ("empty.csv", b"\n", "is empty: expected a header line"),
    ("empty.parquet", b"", "is empty: expected a Parquet file"),
    ("empty.arrow", b"", "is empty: expected an Arrow table"),
    ("bad.jsonl", b'{"prompt": "a"}\n\n{"prompt": \n', "line 3 is not valid JSON"),
    ("list.jsonl", b'{"prompt": "a"}\n[1, 2]\n', "line 2 is a JSON list, not an object"),
    ("binary.jsonl", _BINARY, "line 2 is not UTF-8 text"),
    ("binary.json", _BINARY, "line 2 is not UTF-8 text"),
    ("number.json", b"42\n", "it is one JSON number; expected JSON objects"),
    ("binary.csv", _BINARY, "line 2 is not UTF-8 text"),
    # text but for one string's bytes on a later line: pyarrow reads them as they are (JSON lines) or as binary (CSV)
    ("string.jsonl", b'{"prompt": "a"}\n{"prompt": "<2+\xff\xfe>="}\n', "line 2 is not UTF-8 text"),
    ("string.csv", b"prompt,answer\na,1\n<2+\xff\xfe>=,4\n", "line 3 is not UTF-8 text"),
    ("answer.csv", b"prompt,answer\na,1\nb,\xff\n", "line 3 is not UTF-8 text"),
    ("ragged.csv", b"prompt,answer\na,1\nb,2,3\n", "line 3 has 3 field(s), the header 2"),
    ("header.csv", b"prompt,answer\n", "the table has no rows"),
    ("binary.parquet", _BINARY, "is not a Parquet file"),
    ("cut.parquet", _parquet(500)[:300], "is not a Parquet file"),
    ("rows0.parquet", _parquet(0), "the table has no rows"),
    ("binary.arrow", _BINARY, "is not an Arrow table"),
    ("noprompt.jsonl", b'{"question": "a"}\n', "missing column 'prompt' (string); a 'prompts' table is made by "
                                                "`rlkit prompts` (the file's columns: question)"),
]


@pytest.mark.parametrize("name,content,said", DAMAGED, ids=[d[0] for d in DAMAGED])
def test_every_damaged_data_file_is_one_line_naming_the_file(tmp_path, capfd, name, content, said):
    """Each reader (JSON lines, JSON, CSV, Parquet, Arrow): one RlkitError line naming the file and, in a text file,
    the first bad line; nothing logged by the library before it (datasets logs a file it cannot parse); the file
    unchanged."""
    f = tmp_path / name
    f.write_bytes(content)
    capfd.readouterr()
    with pytest.raises(RlkitError) as e:
        data.load_source(str(f), "prompts", {})
    msg = str(e.value)
    assert said in msg and str(f) in msg and "\n" not in msg and len(msg) < 300, msg
    assert capfd.readouterr().err == ""
    assert f.read_bytes() == content


def test_a_directory_or_an_unreadable_file_is_one_line(tmp_path):
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(RlkitError, match=r"d.jsonl is a directory, expected a data file \(.arrow"):
        data.load_source(str(tmp_path / "d.jsonl"), "prompts", {})
    import os

    f = tmp_path / "locked.jsonl"
    f.write_text('{"prompt": "a"}\n')
    f.chmod(0)
    if os.access(f, os.R_OK):
        pytest.skip("this user reads any file (root)")
    with pytest.raises(RlkitError, match="cannot read .*locked.jsonl: Permission denied"):
        data.load_source(str(f), "prompts", {})


def test_csv_and_json_array_sources(tmp_path):
    (tmp_path / "q.csv").write_text("question,gold\n<1+1>=,2\n<2+2>=,4\n")
    src = data.load_source(str(tmp_path / "q.csv"), "prompts", {"prompt": "question", "answer": "gold"})
    assert src.table.column("prompt").to_pylist() == ["<1+1>=", "<2+2>="]
    assert src.table.column("answer").to_pylist() == ["2", "4"] and src.columns == ("question", "gold")
    (tmp_path / "a.json").write_text(json.dumps([{"prompt": "x"}, {"prompt": "y"}]))
    assert data.load_source(str(tmp_path / "a.json"), "prompts", {}).table.num_rows == 2


def test_a_renamed_missing_column_names_the_files_own_columns(tmp_path):
    j = tmp_path / "q.jsonl"
    j.write_text('{"question": "x", "tests": "[]"}\n')
    with pytest.raises(RlkitError, match=r"no column 'text' \(columns: question, tests\)"):
        data.load_source(str(j), "prompts", {"prompt": "text"})
    assert data.load_source(str(j), "prompts", {"prompt": "question"}).columns == ("question", "tests")
