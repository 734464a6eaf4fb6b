"""Data sources, tokenization and token-budget batching.

A data source is an rlkit table, a plain `.arrow`/`.parquet`/`.jsonl`/`.json`/`.csv` file, or a `datasets` spec
(`name[:config][@split]`), with column-mapping flags to rename the user's columns to rlkit's. When the
data has a `messages` column and the tokenizer has a chat template, the template renders the prompt.
A file that cannot be read is one RlkitError naming it (and, in a text file, its first bad line).
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa

from rlkit.errors import RlkitError
from rlkit.io import fingerprints, manifests, schemas, streams

IGNORE = -100


@dataclass(frozen=True)
class Source:
    """Canonical columns of a loaded data source, plus where it came from."""

    table: pa.Table
    fingerprint: str
    label: str
    chat: bool  # prompts come from a `messages` column through the chat template
    columns: tuple[str, ...] = ()  # the file's own column names, before any renaming (what an error names)

    def head(self, n: int | None) -> Source:
        """The first `n` rows (all when n is None), so later steps render and tokenize only those."""
        return self if n is None or n >= self.table.num_rows else replace(self, table=self.table.slice(0, n))

    def rows(self, start: int, stop: int) -> Source:
        """Rows [start, stop) (a zero-copy slice), so a stage renders and tokenizes one chunk at a time."""
        return replace(self, table=self.table.slice(start, stop - start))


def _quiet_datasets():
    """`datasets`, without its per-load progress bars and info logs on stderr (stages print one line)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


@contextlib.contextmanager
def _silent_datasets():
    """`datasets` logs nothing while a file or spec is read: a file it cannot parse is logged as an error ("Failed
    to load JSON from file ...", through every handler, rlkit's included) before it raises, and rlkit's own line,
    naming the file and the line, says it once."""
    loggers = [logging.getLogger(name) for name in ("datasets", "huggingface_hub")]  # the hub: its retry lines
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


DATA_SUFFIXES = (".arrow", ".parquet", ".jsonl", ".json", ".csv")
# what a data file of each kind holds, as the error about an empty one says it
_EXPECTED = {".jsonl": "one JSON object a line", ".json": "JSON objects, one a line or a list of them",
             ".csv": "a header line, then one row a line", ".parquet": "a Parquet file", ".arrow": "an Arrow table"}
_TEXT = (".jsonl", ".json", ".csv")


def _first_line(e: BaseException) -> str:
    """The first non-blank line of the deepest cause of `e` (a library's wrapper says less), else its type."""
    while (e.__cause__ or e.__context__) is not None and not isinstance(e, RlkitError):
        e = e.__cause__ or e.__context__
    line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    line = "".join(c if c.isprintable() else "?" for c in line)  # a parser quoting binary input
    return line if len(line) <= 160 else line[:157] + "..."


def _not_text(p: Path, expected: str) -> str | None:
    """'line N is not UTF-8 text ...' for the first such line of `p`, None when every line is."""
    with open(p, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return f"line {n} is not UTF-8 text (a binary file?); expected {expected}"
    return None


def _csv_problem(p: Path) -> str | None:
    """The first line of CSV file `p` that is not UTF-8 text or has another number of fields than the header."""
    import csv

    if (why := _not_text(p, _EXPECTED[".csv"])) is not None:
        return why
    with open(p, encoding="utf-8-sig", newline="") as f:
        rows = csv.reader(f)
        try:
            header = next(rows, [])
            for row in rows:
                if row and len(row) != len(header):
                    return f"line {rows.line_num} has {len(row)} field(s), the header {len(header)}"
        except csv.Error as e:
            return f"line {rows.line_num}: {e}"
    return None


def _is_empty(p: Path, text: bool) -> bool:
    """0 bytes, or (a text format) only whitespace."""
    with open(p, "rb") as f:
        while chunk := f.read(1 << 20):
            if not text or chunk.strip():
                return False
    return True


def _json_problem(p: Path) -> str | None:
    """Why `p` is not JSON lines (or, for .json, one JSON document): the first line that is not UTF-8 text, not
    JSON or not an object, by number; None when none is found (the parser's message is then the best there is)."""
    if p.suffix.lower() == ".json" and p.stat().st_size <= 64 << 20:
        try:
            doc = json.loads(p.read_bytes())
        except ValueError:
            pass  # not one document: JSON lines, read line by line below
        else:
            if isinstance(doc, list) and all(isinstance(x, dict) for x in doc) or isinstance(doc, dict):
                return None
            return f"it is one JSON {_json_kind(doc)}; expected {_EXPECTED['.json']}"
    if (why := _not_text(p, _EXPECTED[".jsonl"])) is not None:
        return why
    with open(p, encoding="utf-8-sig") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                return f"line {n} is not valid JSON ({getattr(e, 'msg', e)} at column {getattr(e, 'colno', '?')}); " \
                       f"expected {_EXPECTED['.jsonl']}"
            if not isinstance(obj, dict):
                return f"line {n} is a JSON {_json_kind(obj)}, not an object; expected {_EXPECTED['.jsonl']}"
    return None


def _json_kind(v) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(v), "null" if v is None
                                                                                             else "object")


def _read_file(p: Path, suffix: str) -> pa.Table:
    """The table in data file `p` (not an rlkit table); every failure is one RlkitError naming the file."""
    if suffix == ".arrow":
        import datasets

        try:
            with _silent_datasets():
                return datasets.Dataset.from_file(str(p)).data.table
        except Exception as e:  # noqa: BLE001 (whatever the reader raises, the file is not an Arrow table)
            raise RlkitError(f"{p} is not an Arrow table ({_first_line(e)})") from e
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(p)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise RlkitError(f"{p} is not a Parquet file ({_first_line(e)})") from e
    if suffix == ".csv":
        import pyarrow.csv as pcsv

        try:
            table = pcsv.read_csv(p)
        except (pa.ArrowException, OSError, ValueError) as e:
            why = _csv_problem(p) or f"cannot read it as CSV ({_first_line(e)}); expected {_EXPECTED['.csv']}"
            raise RlkitError(f"{p}: {why}") from e
        # a field that is not UTF-8 makes its column binary (pyarrow's fallback), not an error: name its line
        binary = [f.name for f in table.schema if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)]
        if binary:
            why = _not_text(p, _EXPECTED[".csv"]) or f"column {binary[0]!r} is not UTF-8 text"
            raise RlkitError(f"{p}: {why}")
        return table
    datasets = _quiet_datasets()
    try:
        with _silent_datasets():
            table = datasets.load_dataset("json", data_files=str(p), split="train").data.table
    except Exception as e:  # noqa: BLE001 (datasets wraps the parser's error in its own)
        why = _json_problem(p) or f"cannot read it as JSON lines ({_first_line(e)})"
        raise RlkitError(f"{p}: {why}") from e
    try:  # the JSON reader takes a string's bytes as they are: one that is not UTF-8 is found here, not when read
        table.validate(full=True)
    except pa.ArrowException as e:
        why = _json_problem(p) or f"cannot read it as JSON lines ({_first_line(e)})"
        raise RlkitError(f"{p}: {why}") from e
    return table


def _read_any(source: str) -> tuple[pa.Table | None, str, bool]:
    """(table, fingerprint, is_rlkit_table) for a file path or a datasets spec."""
    p = Path(source)
    if p.exists():
        if p.is_dir():
            raise RlkitError(f"{p} is a directory, expected a data file ({', '.join(DATA_SUFFIXES)})")
        suffix = p.suffix.lower()
        if suffix not in DATA_SUFFIXES:
            raise RlkitError(f"{p}: unsupported data file type {suffix!r}; expected {', '.join(DATA_SUFFIXES)}")
        try:
            if _is_empty(p, suffix in _TEXT):
                raise RlkitError(f"{p} is empty: expected {_EXPECTED[suffix]}")
            if suffix == ".arrow" and manifests.read_manifest(p) is not None:
                return None, "", True
            table = _read_file(p, suffix)
        except OSError as e:
            raise RlkitError(f"cannot read {p}: {e.strerror or _first_line(e)}") from e
        return table, fingerprints.fingerprint(p), False
    if source.startswith((".", "/", "~")) or p.suffix.lower() in DATA_SUFFIXES:
        raise RlkitError(f"{source}: no such file")
    datasets = _quiet_datasets()

    spec, _, split = source.partition("@")
    name, _, config = spec.partition(":")
    try:
        with _silent_datasets():
            ds = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as e:  # noqa: BLE001 (a hub, network or builder error: the spec cannot be loaded)
        raise RlkitError(f"cannot load dataset {source!r}: {_first_line(e)}") from e
    return ds.data.table, f"datasets:{source}:{ds._fingerprint}", False


def load_source(source: str, kind: str, columns: Mapping[str, str | None]) -> Source:
    """Load `source` as a `kind` table ('prompts' or 'sft'), renaming mapped columns first.

    `-` reads an rlkit table from stdin (a pipe from an upstream stage).
    `columns` maps rlkit column names (prompt, completion, answer) to the user's names.
    """
    table, fp, is_rlkit = (None, "", True) if source == "-" else _read_any(source)
    if is_rlkit:
        table, reader = streams.read_table(source, [kind])
        return Source(table, reader.fingerprint, source, chat=False)
    own = tuple(table.column_names)
    if table.num_rows == 0:  # before the columns: an empty file's columns have no types (a header-only CSV)
        raise RlkitError(f"{source}: the table has no rows")
    renames = {user: ours for ours, user in columns.items() if user and user != ours}
    for user in renames:
        if user not in own:
            raise RlkitError(f"{source}: no column {user!r} (columns: {', '.join(own) or 'none'})")
    table = table.rename_columns([renames.get(c, c) for c in table.column_names])
    chat = "messages" in table.column_names and "prompt" not in table.column_names
    if chat:
        msgs = table.column("messages").to_pylist()
        if kind == "sft":
            table = table.append_column("completion", pa.array([m[-1]["content"] if m else "" for m in msgs], pa.string()))
        table = table.append_column("prompt", pa.array([""] * table.num_rows, pa.string()))
    if "prompt_id" not in table.column_names:
        stem = Path(source).stem or "row"
        table = table.append_column("prompt_id", pa.array([f"{stem}-{i}" for i in range(table.num_rows)]))
    if kind == "prefs" and "split" not in table.column_names:
        table = table.append_column("split", pa.array([""] * table.num_rows, pa.string()))  # assigned by the caller
    for col in ("answer", "completion", "prompt_id", "chosen", "rejected"):
        if col in table.column_names and not pa.types.is_string(table.schema.field(col).type):
            idx = table.column_names.index(col)
            table = table.set_column(idx, col, pa.array([None if v is None else str(v) for v in table.column(col).to_pylist()], pa.string()))
    try:
        schemas.validate_schema(table.schema.remove_metadata(), [kind], source)
    except RlkitError as e:
        raise RlkitError(f"{e} (the file's columns: {', '.join(own) or 'none'})") from None
    return Source(table, fp, source, chat=chat, columns=own)


def render_prompts(tokenizer, source: Source, for_sft: bool, tools=None) -> list[str]:
    """Prompt strings, through the chat template when the source is chat-formatted (with `tools`, the JSON schemas
    of an environment's tools, when given: the template's `tools=`)."""
    if not source.chat:
        return source.table.column("prompt").to_pylist()
    if not getattr(tokenizer, "chat_template", None):
        raise RlkitError(
            f"{source.label} has a 'messages' column but the tokenizer has no chat template; "
            "provide prompt/completion columns instead"
        )
    out = []
    for msgs in source.table.column("messages").to_pylist():
        # the final assistant turn is the completion (SFT) or the reference answer (eval): never in the prompt
        turns = msgs[:-1] if msgs and (for_sft or msgs[-1].get("role") == "assistant") else msgs
        kw = {"tools": list(tools)} if tools else {}
        out.append(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False, **kw))
    return out


def encode_texts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of whole texts with the tokenizer's special tokens, but never two BOS in a row: a
    prompt rendered by a chat template that writes the BOS itself (Llama, Gemma) would otherwise get a
    second one from the tokenizer."""
    ids = tokenizer(list(texts), add_special_tokens=True)["input_ids"]
    bos = tokenizer.bos_token_id
    return [x[1:] if bos is not None and len(x) > 1 and x[0] == x[1] == bos else x for x in ids]


def encode_responses(tokenizer, prompts: Sequence[str], responses: Sequence[str]) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids with the tokenizer's special tokens, response ids + eos): a finished response as
    the policy would have generated it."""
    p_ids = encode_texts(tokenizer, prompts)
    r_ids = [x + [tokenizer.eos_token_id] for x in tokenizer(list(responses), add_special_tokens=False)["input_ids"]]
    return p_ids, r_ids


def encode_prompts(tokenizer, prompts: Sequence[str], chat: bool) -> list[list[int]]:
    """Token ids of prompts; a chat template already contains the special tokens it wants."""
    return tokenizer(list(prompts), add_special_tokens=not chat)["input_ids"]


def encode_sft(tokenizer, prompt_ids: Sequence[list[int]], completions: Sequence[str], max_len: int
               ) -> tuple[list[list[int]], list[int], int]:
    """(ids, prompt lengths, truncated count): prompt ids + completion ids + eos, cut at max_len."""
    ids, plens, truncated, _ = encode_sft_masked(tokenizer, prompt_ids, completions, max_len)
    return ids, plens, truncated


def encode_sft_masked(tokenizer, prompt_ids: Sequence[list[int]], completions: Sequence[str], max_len: int
                      ) -> tuple[list[list[int]], list[int], int, list[list[int]] | None]:
    """`encode_sft`, and each kept row's completion mask (1: a target, 0: context), or None when no completion is
    a transcript (`rlkit.tasks.Transcript`: a str with `parts`, (text, written by the model) pairs). A transcript is
    tokenised part by part, as a rollout appends its tokens (the environment's text `tokenizer(text,
    add_special_tokens=False)`), its model turns and the eos 1, the environment's text 0; a row cut at max_len with
    no target left is dropped, as one with no completion is."""
    parts = [list(c.parts) if isinstance(getattr(c, "parts", None), tuple) else None for c in completions]
    flat = [t for ps in parts if ps is not None for t, _ in ps]
    enc = iter(tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else ())
    plain = iter(tokenizer([c for c, ps in zip(completions, parts, strict=True) if ps is None],
                           add_special_tokens=False)["input_ids"] if any(ps is None for ps in parts) else ())
    masked = any(ps is not None for ps in parts)
    ids, plens, masks, truncated = [], [], [], 0
    for p, ps in zip(prompt_ids, parts, strict=True):
        if ps is None:
            c = list(next(plain))
            m = [1] * len(c)
        else:
            c, m = [], []
            for _, model in ps:
                tok = list(next(enc))
                c += tok
                m += [int(model)] * len(tok)
        seq, m = [*p, *c, tokenizer.eos_token_id], [*m, 1]
        if len(seq) > max_len:
            truncated += 1
            seq = seq[:max_len]
            m = m[:max(0, max_len - len(p))]
        if len(p) >= len(seq) or not any(m):
            continue  # nothing left to learn from
        ids.append(seq)
        plens.append(len(p))
        masks.append(m)
    return ids, plens, truncated, masks if masked else None


def token_batches(lengths: Sequence[int], budget: int, rng: random.Random | None = None) -> list[list[int]]:
    """Group indices so that each batch's padded size (rows x longest row) stays within `budget`.

    With `rng`, examples are shuffled, sorted by length inside windows (little padding, still
    random) and the batches shuffled; without it, order is by length (inference).
    """
    idx = list(range(len(lengths)))
    if rng is not None:
        rng.shuffle(idx)
        window = 64 * max(1, budget // max(1, max(lengths, default=1)))
        idx = [i for w in range(0, len(idx), window) for i in sorted(idx[w:w + window], key=lengths.__getitem__)]
    else:
        idx.sort(key=lengths.__getitem__)
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in idx:
        longest_if = max(longest, lengths[i])
        if cur and longest_if * (len(cur) + 1) > budget:
            batches.append(cur)
            cur, longest_if = [], lengths[i]
        cur.append(i)
        longest = longest_if
    if cur:
        batches.append(cur)
    if rng is not None:
        rng.shuffle(batches)
    return batches


def collate_sft(ids: Sequence[list[int]], plens: Sequence[int], pad_id: int):
    """Right-padded (B, T) input_ids, attention_mask and labels (-100 on prompt and pad tokens)."""
    import torch

    T = max(len(s) for s in ids)
    input_ids = torch.full((len(ids), T), pad_id, dtype=torch.long)
    labels = torch.full((len(ids), T), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(ids), T), dtype=torch.long)
    for b, (s, p) in enumerate(zip(ids, plens, strict=True)):
        input_ids[b, : len(s)] = torch.tensor(s)
        labels[b, p : len(s)] = torch.tensor(s[p:])
        mask[b, : len(s)] = 1
    return input_ids, mask, labels
