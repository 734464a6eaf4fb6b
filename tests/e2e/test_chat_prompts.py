"""Chat-formatted prompts: rollout, score-ref, update and eval agree token for token on the prompt the
tokenizer's chat template renders from a `messages` column (one BOS, written by the template), run as
the real stages in subprocesses."""

import json
import shutil
import subprocess

import pytest

from rlkit.io import checkpoints, streams
from rlkit.io.data import encode_responses, encode_texts
from rlkit.scorers.reward_model import encode_pairs

from conftest import fast_rlkit_cmd, run_cli

pytestmark = pytest.mark.slow

# like Llama's and Gemma's templates, this one writes the BOS itself
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def chat_policy(sft_dir, tmp_path_factory):
    """The session's SFT checkpoint with a chat template on its tokenizer."""
    d = tmp_path_factory.mktemp("chat") / "policy"
    shutil.copytree(sft_dir, d)
    tok = checkpoints.load_tokenizer(d)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(d)
    return d


def _rows():
    rows = [{"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"<{a}+{b}>="}],
             "answer": str(a + b)} for a, b in ((3, 4), (10, 2), (7, 7), (1, 18), (5, 0))]
    # a final assistant turn is the reference answer, never part of the prompt
    rows.append({"messages": [{"role": "user", "content": "<2+2>="}, {"role": "assistant", "content": "4"}],
                 "answer": "4"})
    return rows


def test_every_stage_sees_the_same_prompt_tokens(chat_policy, tmp_path):
    rows = _rows()
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = checkpoints.load_tokenizer(chat_policy)
    turns = [r["messages"][:-1] if r["messages"][-1]["role"] == "assistant" else r["messages"] for r in rows]
    texts = [tok.apply_chat_template(t, add_generation_prompt=True, tokenize=False) for t in turns]
    want = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    hf = [tok.apply_chat_template(t, add_generation_prompt=True, tokenize=True) for t in turns]
    assert want == [x["input_ids"] if hasattr(x, "keys") else x for x in hf]  # HF's own way
    bos = tok.bos_token_id
    assert all(ids[0] == bos and ids.count(bos) == 1 for ids in want)  # one BOS, the template's

    ev = subprocess.Popen([*fast_rlkit_cmd(), "eval", "--policy", str(chat_policy), "--prompts", str(data), "--json",
                           "--num-prompts", "6"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ref = tmp_path / "ref"
    r = run_cli("freeze-ref", "--policy", str(chat_policy), "--out", str(ref), "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    scored = tmp_path / "scored.arrow"
    p1 = subprocess.Popen([*fast_rlkit_cmd(), "rollout", "--policy", str(chat_policy), "--prompts", str(data), "--n", "2",
                           "--max-new-tokens", "6"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p2 = subprocess.run([*fast_rlkit_cmd(), "score-ref", "--ref", str(ref), "--out", str(scored)], stdin=p1.stdout,
                        capture_output=True)
    p1.stdout.close()
    assert p1.wait() == 0 and p2.returncode == 0, (p1.stderr.read(), p2.stderr)
    metrics = tmp_path / "m.jsonl"
    u = run_cli("update", "--policy", str(chat_policy), "--in", str(scored), "--out", str(tmp_path / "u"),
                "--old-logprobs", "recompute", "--epochs", "1", "--metrics", str(metrics))
    assert u.returncode == 0, u.stderr
    out, err = ev.communicate(timeout=300)
    assert ev.returncode == 0, err

    # rollout: the rendered text and its ids, the same for both samples of a prompt
    table, _ = streams.read_table(scored, ["scored"])
    by_prompt = {}
    for x in table.to_pylist():
        by_prompt.setdefault(x["prompt_id"], []).append(x)
    assert [[x["prompt"] for x in g] for g in by_prompt.values()] == [[t, t] for t in texts]
    assert [[x["prompt_ids"] for x in g] for g in by_prompt.values()] == [[w, w] for w in want]
    # score-ref scored those ids: the reference (the same weights in fp32) gives the sampler's log-probs
    for x in table.to_pylist():
        assert x["ref_logprobs"] == pytest.approx(x["old_logprobs"], abs=1e-4)
    # update trained on those ids: recomputing pi_old from them gives the sampler's log-probs
    m = json.loads(metrics.read_text())
    assert m["logprob_mismatch"] < 1e-4 and m["logprob_mismatch_max"] < 1e-3
    # eval generated from those ids
    res = json.loads(out)
    assert [s["prompt_ids"] for s in res["samples"]] == want[:5] and res["n_scored"] == 6


def test_text_encodings_never_double_the_template_bos(chat_policy):
    """Reward models and DPO re-tokenize prompt text with the tokenizer's special tokens: a template that
    writes the BOS must not get a second one (the tokenizer here adds a BOS of its own)."""
    tok = checkpoints.load_tokenizer(chat_policy)
    text = tok.apply_chat_template([{"role": "user", "content": "<3+4>="}], add_generation_prompt=True,
                                   tokenize=False)
    bos = tok.bos_token_id
    assert tok(text, add_special_tokens=True)["input_ids"][:2] == [bos, bos]  # what a plain call does
    (ids,) = encode_texts(tok, [text])
    assert ids == tok(text, add_special_tokens=False)["input_ids"] and ids.count(bos) == 1
    (pair,) = encode_pairs(tok, [text], ["7"], 1024)
    assert pair.count(bos) == 1 and pair[: len(ids)] == ids
    (p_ids,), _ = encode_responses(tok, [text], ["7"])
    assert p_ids == ids
    assert encode_texts(tok, ["<3+4>="])[0][:2] == [bos, tok.convert_tokens_to_ids("<")]  # plain text: one BOS added
