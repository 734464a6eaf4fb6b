"""`rollout` streams its prompts: they are drawn (or sliced from the file), rendered and tokenized one
generation chunk at a time, so any --num-prompts starts writing at once in flat memory, and the chunks are
exactly those of the whole prompt list (same prompts, positions and so seeds), shards included."""

import subprocess
import threading
import time

import pyarrow as pa
import pytest

from rlkit.io import data, shards
from rlkit.sampling.rows import file_chunks, first_made, task_chunks, task_total
from rlkit.stages.rollout import RolloutConfig
from rlkit.tasks import get_task

from conftest import rlkit_cmd

FINITE = '''
class Finite:
    """90 train examples, then the stream ends."""

    def iter_examples(self, split, seed):
        for i in range(90):
            yield {"prompt": f"<{i % 10}-0>=", "answer": str(i % 10)}

    def reward(self, response, answer):
        return 0.0
'''


class CharTokenizer:
    """Stands in for a tokenizer: one id per character, 1 as BOS when special tokens are asked for."""

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[1] * add_special_tokens + [ord(c) for c in t] for t in texts]}


def _flat(chunks):
    """(c0 of each chunk, prompt ids, answers, texts, token ids of every prompt, in order)."""
    chunks = list(chunks)
    return ([c.c0 for c in chunks], [x for c in chunks for x in c.ids], [x for c in chunks for x in c.answers],
            [x for c in chunks for x in c.texts], [x for c in chunks for x in c.prompt_ids])


@pytest.mark.parametrize("spec", ["arithmetic", "math", "FINITE"])
@pytest.mark.parametrize("shard", [None, "0/2", "1/2", "2/3"])
def test_task_chunks_are_the_whole_list_cut_up(tmp_path, spec, shard):
    """The chunks a job samples are its span of `task.examples(train, n, seed)`, cut every --chunk-prompts
    from the run's start (what the table was built from before prompts streamed); a finite user task's
    shards cut the prompts it has."""
    if spec == "FINITE":
        (tmp_path / "finite.py").write_text(FINITE)
        spec = f"{tmp_path}/finite.py:Finite"
    task = get_task(spec)
    cfg = RolloutConfig(policy=tmp_path, num_prompts=150, seed=3, chunk_prompts=32, shard=shard)
    ex = task.examples("train", cfg.num_prompts, cfg.seed)
    total = task_total(task, cfg.num_prompts, cfg.seed)
    assert total == len(ex) == (90 if "Finite" in spec else 150)
    span = shards.prompt_span(shards.parse(shard), total, 32) if shard else range(cfg.num_prompts)
    c0s, ids, answers, texts, prompt_ids = _flat(first_made(task_chunks(task, CharTokenizer(), cfg.seed, span, cfg.chunk_prompts)))
    want = ex[span.start:span.stop]
    assert c0s == list(range(span.start, min(span.stop, len(ex)), 32))
    assert ids == [e.prompt_id for e in want] and answers == [e.answer for e in want]
    assert texts == [e.prompt for e in want] and prompt_ids == CharTokenizer()(texts)["input_ids"]


def test_file_chunks_render_and_tokenize_each_chunk_as_the_whole_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(f'{{"prompt": "<{i}+1>=", "answer": "{i + 1}"}}\n' for i in range(100)))
    source = data.load_source(str(f), "prompts", {"prompt": "prompt", "answer": "answer"}).head(70)
    tok = CharTokenizer()
    for span in (range(70), range(32, 64), range(64, 70)):
        c0s, ids, answers, texts, prompt_ids = _flat(file_chunks(source, tok, span, 32))
        t = source.table.slice(span.start, len(span))
        assert c0s == list(range(span.start, span.stop, 32))
        assert ids == t.column("prompt_id").to_pylist() and answers == t.column("answer").to_pylist()
        assert texts == data.render_prompts(tok, source, for_sft=False)[span.start:span.stop]
        assert prompt_ids == data.encode_prompts(tok, texts, False)


def _hwm_kb(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), in kB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _stream(policy, num_prompts: int, batches: int, tmp_path, timeout: float = 300) -> tuple[list[int], float]:
    """Run `rollout --num-prompts N` into a pipe, read `batches` record batches and kill it.
    -> (VmHWM in kB after the first batch and after the last one read, seconds to the first batch)."""
    err = tmp_path / f"err-{num_prompts}.txt"
    with open(err, "wb") as e:
        p = subprocess.Popen([*rlkit_cmd(), "rollout", "--policy", str(policy), "--engine", "hf", "--num-prompts",
                              str(num_prompts), "--max-new-tokens", "2", "--n", "1"], stdout=subprocess.PIPE, stderr=e)
    killer = threading.Timer(timeout, p.kill)  # a run that never writes fails the test, it does not hang it
    killer.start()
    t0 = time.monotonic()
    try:
        reader = pa.ipc.open_stream(p.stdout)
        hwm = []
        for i in range(batches):
            reader.read_next_batch()
            if i == 0:
                first = time.monotonic() - t0
            if i in (0, batches - 1):
                hwm.append(_hwm_kb(p.pid))
    except (pa.ArrowInvalid, StopIteration, OSError) as ex:
        raise AssertionError(f"no {batches} batches from rollout --num-prompts {num_prompts} within {timeout}s "
                             f"({ex}): {err.read_text()[-2000:]}") from ex
    finally:
        killer.cancel()
        p.kill()
        p.wait()
        p.stdout.close()
    return hwm, first


@pytest.mark.slow
def test_a_billion_prompts_start_at_once_in_flat_memory(sft_dir, tmp_path):
    """--num-prompts 1e9 used to build every prompt before writing (+33 MB/s, no output): now its first
    batch comes as soon as a small run's, peak memory is a small run's, and it stays flat batch after batch."""
    small, _ = _stream(sft_dir, 5000, 1, tmp_path)  # 79 chunks: still running (or blocked on the pipe) at batch 1
    big, first = _stream(sft_dir, 1_000_000_000, 20, tmp_path)
    mb = 1024
    print(f"first batch after {first:.1f}s; VmHWM small {small[0] / mb:.0f} MB, big {big[0] / mb:.0f} MB at batch 1, "
          f"{big[1] / mb:.0f} MB at batch 20")
    assert big[0] < small[0] + 100 * mb, (small, big)
    assert big[1] < big[0] + 64 * mb, big
