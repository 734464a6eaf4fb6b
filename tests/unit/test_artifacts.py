"""Artifact round trips, schema rejections, end markers, fingerprints, atomic writes."""

import json
import os
import subprocess

import datasets
import pyarrow as pa
import pytest

from rlkit.errors import RlkitError, TruncatedStream
from rlkit.io import atomic, claims, fingerprints, manifests, schemas, streams


def _prompts(path, n=10, cfg=None, chunk=4):
    m = manifests.make_manifest("prompts", "prompts", cfg or {"n": n}, {})
    with streams.write_table("prompts", path, m) as w:
        for i in range(0, n, chunk):
            ids = range(i, min(n, i + chunk))
            w.write({"prompt_id": [f"p{j}" for j in ids], "prompt": [f"<{j}+1>=" for j in ids],
                     "answer": [str(j + 1) for j in ids], "split": ["train"] * len(ids)})
    return path


def test_round_trip_with_manifest_and_plain_readers(tmp_path):
    p = _prompts(tmp_path / "p.arrow", n=10)
    table, reader = streams.read_table(p, ["prompts"])
    assert table.num_rows == 10 and table.column("prompt")[3].as_py() == "<3+1>="
    assert reader.manifest["kind"] == "prompts" and reader.manifest["schema_version"] == 1
    assert reader.manifest["command"] == "prompts" and reader.manifest["config"] == {"n": 10}
    assert reader.manifest["rlkit_version"] and reader.manifest["created"]
    # plain pyarrow and datasets read the same file (the end marker is an empty batch)
    assert pa.ipc.open_stream(p.read_bytes()).read_all().num_rows == 10
    ds = datasets.Dataset.from_file(str(p))
    assert ds.num_rows == 10 and ds[9]["answer"] == "10"


def test_wrong_kind_names_both_kinds_and_the_producer(tmp_path):
    p = tmp_path / "prefs.arrow"
    m = manifests.make_manifest("prefs", "build-prefs", {}, {})
    with streams.write_table("prefs", p, m) as w:
        w.write({"prompt_id": ["a"], "prompt": ["x"], "chosen": ["1"], "rejected": ["2"], "split": ["train"]})
    with pytest.raises(RlkitError, match=r"is a 'prefs' table, expected a 'prompts' table \(made by `rlkit prompts`\)"):
        streams.read_table(p, ["prompts"])


def _plain(path, table):
    with pa.ipc.new_stream(str(path), table.schema) as w:
        w.write_table(table)
    return path


def test_missing_and_mistyped_columns(tmp_path):
    p = _plain(tmp_path / "a.arrow", pa.table({"prompt_id": ["a"], "text": ["x"]}))
    with pytest.raises(RlkitError, match=r"missing column 'prompt' \(string\).*`rlkit prompts`"):
        streams.read_table(p, ["prompts"])
    p = _plain(tmp_path / "b.arrow", pa.table({"prompt_id": ["a"], "prompt": [3]}))
    with pytest.raises(RlkitError, match="column 'prompt' has type int64, expected string"):
        streams.read_table(p, ["prompts"])


def test_plain_table_with_the_right_columns_is_accepted(tmp_path):
    p = _plain(tmp_path / "a.arrow", pa.table({"prompt_id": ["a"], "prompt": pa.array(["x"], pa.large_string())}))
    table, reader = streams.read_table(p, ["prompts"])
    assert table.num_rows == 1 and reader.manifest is None


def test_empty_table_is_rejected_unless_allowed(tmp_path):
    p = _prompts(tmp_path / "e.arrow", n=0)
    with pytest.raises(RlkitError, match="has no rows"):
        streams.read_table(p, ["prompts"])
    assert streams.read_table(p, ["prompts"], require_rows=False)[0].num_rows == 0


def test_stream_cut_at_a_batch_boundary_is_detected(tmp_path):
    full = _prompts(tmp_path / "p.arrow", n=12).read_bytes()
    # find a cut after the second batch: write the same batches without closing the writer
    p = tmp_path / "cut.arrow"
    m = manifests.make_manifest("prompts", "prompts", {}, {})
    schema = schemas.kind("prompts").schema(manifest=m)
    with open(p, "wb") as f:
        writer = pa.ipc.new_stream(f, schema)
        writer.write_batch(pa.record_batch([pa.array(["a"]), pa.array(["x"]), pa.array(["1"]), pa.array(["t"]),
                                            pa.nulls(1, schema.field("messages").type)], schema=schema))
        f.flush()  # no end marker, no EOS: what a killed producer leaves
    # plain pyarrow reads this as a valid one-row stream; rlkit does not
    assert pa.ipc.open_stream(p.read_bytes()).read_all().num_rows == 1
    with pytest.raises(TruncatedStream, match="without rlkit's end marker"):
        streams.read_table(p, ["prompts"])
    p2 = tmp_path / "mid.arrow"
    p2.write_bytes(full[: len(full) // 2])
    with pytest.raises(TruncatedStream):
        streams.read_table(p2, ["prompts"])


def test_open_table_reads_ahead_so_a_piped_producer_never_blocks(tmp_path):
    """A producer writing far more than a pipe buffer (64 KiB) finishes while the consumer is still
    busy (importing torch, loading a model): the background thread drains the pipe into memory."""
    src = _prompts(tmp_path / "big.arrow", n=20_000, chunk=1000)
    assert src.stat().st_size > 8 * 65536
    r, w = os.pipe()
    producer = subprocess.Popen(["cat", str(src)], stdout=w)
    os.close(w)
    try:
        pending = streams.open_table(f"/dev/fd/{r}", ["prompts"])
        assert producer.wait(timeout=60) == 0  # finished with nobody consuming yet
        reader = pending.result()
        table = reader.read_all()
    finally:
        os.close(r)
    assert table.num_rows == 20_000 and table.column("prompt_id")[19_999].as_py() == "p19999"
    assert reader.manifest["kind"] == "prompts"


def test_open_table_raises_open_and_stream_errors_at_the_consumer(tmp_path):
    bad = tmp_path / "x.arrow"
    bad.write_text("hello")
    pending = streams.open_table(bad, ["prompts"])
    with pytest.raises(RlkitError, match="not an Arrow IPC stream"):
        pending.result()
    full = _prompts(tmp_path / "p.arrow", n=12).read_bytes()
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(full[: len(full) // 2])
    reader = streams.open_table(cut, ["prompts"]).result()
    with pytest.raises(TruncatedStream):
        reader.read_all()


def test_not_an_arrow_file(tmp_path):
    p = tmp_path / "x.arrow"
    p.write_text("hello")
    with pytest.raises(RlkitError, match="not an Arrow IPC stream"):
        streams.read_table(p, ["prompts"])
    with pytest.raises(RlkitError, match="no such file"):
        streams.read_table(tmp_path / "missing.arrow", ["prompts"])


def test_failed_write_leaves_nothing_and_keeps_the_old_file(tmp_path):
    p = _prompts(tmp_path / "p.arrow", n=5)
    before = p.read_bytes()
    with pytest.raises(KeyboardInterrupt):
        with streams.write_table("prompts", p, manifests.make_manifest("prompts", "prompts", {}, {})) as w:
            w.write({"prompt_id": ["z"], "prompt": ["y"]})
            raise KeyboardInterrupt
    assert p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["p.arrow"]


def test_atomic_dir_replaces_only_on_success(tmp_path):
    out = tmp_path / "m"
    with atomic.atomic_dir(out) as d:
        (d / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic.atomic_dir(out) as d:
            (d / "a").write_text("2")
            raise RuntimeError
    assert (out / "a").read_text() == "1" and sorted(os.listdir(tmp_path)) == ["m"]
    with atomic.atomic_dir(out) as d:
        (d / "b").write_text("3")
    assert sorted(os.listdir(out)) == ["b"] and sorted(os.listdir(tmp_path)) == ["m"]


def test_check_out_refuses_foreign_files(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("precious")
    with pytest.raises(RlkitError, match="not an rlkit table; refusing to overwrite"):
        claims.check_out(f, "table")
    d = tmp_path / "somedir"
    d.mkdir()
    (d / "x").write_text("precious")
    with pytest.raises(RlkitError, match="not an rlkit checkpoint"):
        claims.check_out(d, "model")
    with pytest.raises(RlkitError, match="is a file, expected a model directory"):
        claims.check_out(f, "model")
    claims.check_out(_prompts(tmp_path / "ok.arrow"), "table")  # an rlkit table may be replaced
    claims.check_out(tmp_path / "new.arrow", "table")



def test_a_swap_that_fails_leaves_no_temporary(tmp_path):
    """The rename into place itself fails (a directory over a file): the temporary goes, the file stays."""
    out = tmp_path / "m"
    out.write_text("precious")
    with pytest.raises(OSError):
        with atomic.atomic_dir(out) as d:
            (d / "a").write_text("1")
    assert sorted(os.listdir(tmp_path)) == ["m"] and out.read_text() == "precious"


def test_check_outputs_side_outputs(tmp_path):
    """--metrics and --tensorboard are claimed like --out: not an input, not another output, of their form."""
    table = _prompts(tmp_path / "p.arrow")
    ins = {"--in": table}
    metrics = {"--metrics": (tmp_path / "m.jsonl", "metrics")}
    claims.check_outputs({"--out": (tmp_path / "o", "model"), **metrics}, ins)  # new paths: fine
    with pytest.raises(RlkitError, match=r"--metrics .*p.arrow is one of this stage's inputs \(--in"):
        claims.check_outputs({"--metrics": (table, "metrics")}, ins)
    with pytest.raises(RlkitError, match=r"--metrics .*/o/m.jsonl lies inside --out"):
        claims.check_outputs({"--out": (tmp_path / "o", "model"), "--metrics": (tmp_path / "o/m.jsonl", "metrics")})
    with pytest.raises(RlkitError, match="is an rlkit 'prompts' table, not a metrics file"):
        claims.check_outputs({"--metrics": (table, "metrics")})
    tb = tmp_path / "tb"
    tb.mkdir()
    (tb / "events.out.tfevents.1.host").write_bytes(b"\0")
    claims.check_outputs({"--tensorboard": (tb, "events")})  # only event files: fine
    (tb / "notes.txt").write_text("x")
    with pytest.raises(RlkitError, match="holds notes.txt, which is not a TensorBoard event file"):
        claims.check_outputs({"--tensorboard": (tb, "events")})
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "rlkit.json").write_text("{}")
    with pytest.raises(RlkitError, match="lies inside the checkpoint"):
        claims.check_outputs({"--metrics": (ck / "m.jsonl", "metrics")})
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(RlkitError, match="symbolic link that leads nowhere"):
        claims.check_outputs({"--out": (tmp_path / "loop", "model")})
    (tmp_path / "link").symlink_to(ck)
    with pytest.raises(RlkitError, match="is a symbolic link \\(to "):
        claims.check_outputs({"--out": (tmp_path / "link", "model")})
    with pytest.raises(RlkitError, match="its parent .*p.arrow is a file, not a directory"):
        claims.check_outputs({"--out": (table / "sub.arrow", "table")})


def test_metrics_files_take_rows_only_of_metrics(tmp_path):
    from rlkit.io import metrics_log

    m = tmp_path / "m.jsonl"
    metrics_log.check_target("--metrics", m)  # new
    metrics_log.write({"stage": "eval", "step": 0, "accuracy": 0.5}, m)
    metrics_log.check_target("--metrics", m)  # rlkit's rows
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2"}\n')
    with pytest.raises(RlkitError, match=r"not a metrics file \(line 1 is not a JSON row with 'stage' and 'step'\)"):
        metrics_log.check_target("--metrics", data)


def test_a_metrics_row_is_taken_back_when_its_output_fails(tmp_path):
    """`appending`: the row goes in first and comes out again if the block raises (the checkpoint it describes
    was not written); a file it made goes entirely."""
    from rlkit.io import metrics_log

    m = tmp_path / "sub" / "m.jsonl"
    with pytest.raises(RuntimeError):
        with metrics_log.appending({"stage": "update", "step": 1}, m):
            assert m.read_text().count("\n") == 1
            raise RuntimeError
    assert os.listdir(tmp_path) == []  # the file and the folder it made
    metrics_log.write({"stage": "update", "step": 1}, m)
    before = m.read_bytes()
    with pytest.raises(RuntimeError):
        with metrics_log.appending({"stage": "update", "step": 2}, m):
            raise RuntimeError
    assert m.read_bytes() == before
    with metrics_log.appending({"stage": "update", "step": 2}, m):
        pass
    assert [json.loads(line)["step"] for line in m.read_text().splitlines()] == [1, 2]

def test_fingerprint_follows_content_and_rewrites(tmp_path):
    a = _prompts(tmp_path / "a.arrow", cfg={"x": 1})
    fp = fingerprints.fingerprint(a)
    assert fp == fingerprints.fingerprint(a)
    _prompts(a, cfg={"x": 2})
    assert fingerprints.fingerprint(a) != fp
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text("{}")
    big = d / "model.safetensors"
    big.write_bytes(b"0" * 10)
    fd = fingerprints.fingerprint(d)
    big.write_bytes(b"1" * 10)
    assert fingerprints.fingerprint(d) != fd


def test_big_files_are_fingerprinted_by_stat(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprints, "CONTENT_HASH_LIMIT", 4)
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"0123456789")
    fp = fingerprints.fingerprint(f)
    os.utime(f, ns=(1, 1))
    assert fingerprints.fingerprint(f) != fp  # a rewrite (new mtime) changes it without reading content


def test_up_to_date_compares_command_config_and_inputs(tmp_path):
    p = tmp_path / "p.arrow"
    m = manifests.make_manifest("prompts", "prompts", {"num": 3, "force": False}, {"src": "sha256:1"})
    with streams.write_table("prompts", p, m) as w:
        w.write({"prompt_id": ["a"], "prompt": ["b"]})
    assert manifests.up_to_date(p, "prompts", {"num": 3, "force": True}, {"src": "sha256:1"})
    assert not manifests.up_to_date(p, "prompts", {"num": 4}, {"src": "sha256:1"})
    assert not manifests.up_to_date(p, "prompts", {"num": 3}, {"src": "sha256:2"})
    assert not manifests.up_to_date(p, "sft", {"num": 3}, {"src": "sha256:1"})
    assert not manifests.up_to_date(tmp_path / "nope.arrow", "prompts", {"num": 3}, {})


def test_rollout_kinds_carry_named_reward_components(tmp_path):
    extra = [pa.field("reward/verifier", pa.float64())]
    p = tmp_path / "r.arrow"
    row = {"prompt_id": ["a"], "group_id": [0], "sample_idx": [0], "prompt": ["<1+1>="], "completion": ["2"],
           "prompt_ids": [[1, 2]], "completion_ids": [[3]], "old_logprobs": [[-0.1]], "finish_reason": ["eos"],
           "policy_fingerprint": ["sha256:x"], "policy_step": [0], "reward/verifier": [1.0]}
    with streams.write_table("rollouts", p, manifests.make_manifest("rollouts", "rollout", {}, {}), extra) as w:
        w.write(row)
    table, _ = streams.read_table(p, ["rollouts", "scored"])
    assert table.column("reward/verifier").to_pylist() == [1.0]
    with pytest.raises(RlkitError, match="expected a 'scored' table"):
        streams.read_table(p, ["scored"])


def test_ctrl_c_inside_pyarrows_first_conversion_is_raised_after_it():
    """pyarrow imports pandas on its first `pa.array` and swallows what that import raises: a Ctrl-C landing
    there was lost (the stage wrote on to the end, exit 0). The writer loads it first with the signal held, and
    raises it right after. Here the signal arrives inside that first conversion (sent by a wrapper around it)."""
    import subprocess
    import sys

    code = (
        "import signal, threading, pyarrow as pa\n"
        # Ctrl-C's default handler: a child of a process that ignores SIGINT (a test runner's worker) starts ignoring it
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from rlkit.io import streams\n"
        "real = pa.array\n"
        "def first(*a, **k):\n"
        # to this thread: a signal sent to the process may go to another of its threads (pyarrow's), which on a
        # loaded machine runs its handler only after this short program has ended ('lost', wrongly)
        "    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)\n"
        "    return real(*a, **k)\n"
        "streams.pa.array = first\n"
        "try:\n"
        "    streams._load_pyarrow_converters()\n"
        "    print('lost')\n"
        "except KeyboardInterrupt:\n"
        "    print('raised after', streams._PYARROW_READY)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "raised after True", (r.stdout, r.stderr)
