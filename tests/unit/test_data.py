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
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(RlkitError, match="unsupported data file type"):
        data.load_source(str(tmp_path / "x.csv"), "prompts", {})


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
