"""A multi-turn rollouts/scored table shown to a person (`rlkit inspect`): its trajectory figures as a table
(`figures_table`) and each shown row as its conversation (`conversations`), decoded with the tokenizer that
sampled it where that is still there (`Seen`), so the environment's tokens read exactly as the model saw them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

MESSAGE_CHARS = 2000  # of one message's content, shown


def figures_table(fig: dict[str, Any]):
    from rich.table import Table

    def num(v) -> str:
        return "-" if v is None else f"{v:.3g}"

    t = Table(title="multi-turn trajectories", show_header=False)
    t.add_row("trajectories", f"{fig['trajectories']:,}")
    t.add_row("turns per trajectory (mean)", num(fig["mean_turns"]))
    t.add_row("tool calls per trajectory (mean)", num(fig["mean_tool_calls"]))
    if "end_reasons" in fig:
        t.add_row("end reasons", ", ".join(f"{k} {v:,}" for k, v in fig["end_reasons"].items()))
    if fig.get("continued_rows"):
        t.add_row("rows continued in the next row", f"{fig['continued_rows']:,} (a chat template re-rendered history)")
    t.add_row("sampled tokens per trajectory (mean, loss_mask 1)", num(fig["mean_response_tokens"]))
    t.add_row("environment tokens per trajectory (mean, loss_mask 0)", num(fig["mean_environment_tokens"]))
    t.add_row("environment's share of completion tokens", f"{fig['environment_token_fraction']:.1%}")
    t.add_row("reward/env (mean)", num(fig["mean_reward_env"]))
    return t


@dataclass
class Seen:
    """What turns a row's tokens back into what the model saw: the tokenizer that sampled the table (the policy its
    manifest names, when that is still there with the same tokenizer) and `--max-env-tokens`; `note`: why the
    conversations are shown from `messages` instead (the environment's text as it wrote it)."""

    tokenizer: Any = None
    max_env_tokens: int | None = None
    note: str | None = None

    @classmethod
    def of(cls, manifest: dict) -> Seen:
        from rlkit.io import checkpoints
        from rlkit.io.manifests import Manifest

        m = Manifest.parse(manifest)
        policy, limit = m.sampling.get("policy"), m.sampling.get("max_env_tokens")
        limit = limit if isinstance(limit, int) else None
        plain = "the conversations below are the messages as the environment wrote them"
        if not policy or not (Path(str(policy)) / "tokenizer_config.json").is_file():
            return cls(None, limit, f"({plain}: the policy that sampled them{f', {policy},' if policy else ''} is "
                                    "not there to decode their tokens)")
        try:
            from rlkit.io.model_files import load_tokenizer

            tok = load_tokenizer(policy)
        except Exception as e:  # noqa: BLE001 (a tokenizer that does not load: the messages, said so)
            from rlkit.plugins.user_code import one_line

            return cls(None, limit, f"({plain}: the tokenizer of {policy} does not load: {one_line(e)})")
        if m.tokenizer and m.tokenizer != checkpoints.tokenizer_fingerprint(tok):
            return cls(None, limit, f"({plain}: {policy} now has another tokenizer than the one that sampled them)")
        return cls(tok, limit)


def segments(ids: list[int], mask: list[int]) -> list[tuple[bool, list[int]]]:
    """The completion's runs: (sampled by the model?, its tokens), in order (loss_mask 1 runs and 0 runs)."""
    out: list[tuple[bool, list[int]]] = []
    for t, m in zip(ids, mask, strict=False):
        if out and out[-1][0] == (m == 1):
            out[-1][1].append(t)
        else:
            out.append((m == 1, [t]))
    return out


def conversations(rows: list[dict], seen: Seen | None = None) -> list:
    """Each shown row of a multi-turn table as rich Text: a line of its figures (turns, tool calls, how it
    ended, its rewards, its sampled and environment tokens), then its conversation, each part marked with its role
    and the environment's marked so. With the tokenizer that sampled it (`seen`) the conversation is what the model
    saw: the prompt, then the completion decoded from its tokens, the model's turns (loss_mask 1) and the
    observations exactly as appended (loss_mask 0, chat-template markup included), an observation that
    --max-env-tokens cut marked `[cut at N tokens]` (from the row's `observation_tokens`, each observation's length
    before the cut; without that column, one that reached the limit says it may have been cut). Without it, the
    `messages` (the environment's text as it wrote it); a row without messages shows its completion."""
    from rich.text import Text

    out: list = []
    for i, row in enumerate(rows):
        head = [f"row {i}", f"prompt {row.get('prompt_id')!r}", f"sample {row.get('sample_idx')}"]
        for key, unit in (("turns", "turn"), ("tool_calls", "tool call")):
            if isinstance(row.get(key), int):
                head.append(f"{row[key]} {unit}{'' if row[key] == 1 else 's'}")
        if row.get("end_reason"):
            head.append(f"ended: {row['end_reason']}")
        rewards = [f"{k} {v:g}" for k, v in row.items() if k.startswith("reward/") and isinstance(v, (int, float))]
        if rewards:
            head.append(", ".join(rewards))
        ids, mask = row.get("completion_ids") or [], row.get("loss_mask")
        sampled = len(ids) if mask is None else sum(1 for m in mask if m == 1)
        head.append(f"tokens: {sampled:,} sampled + {len(ids) - sampled:,} from the environment")
        text = Text(" · ".join(head) + "\n", style="bold")
        msgs = row.get("messages") or [{"role": "completion", "content": str(row.get("completion") or "")}]
        if seen is not None and seen.tokenizer is not None and ids and mask is not None:
            _as_seen(text, row, msgs, ids, mask, seen)
            out.append(text)
            continue
        answered = False  # the messages after the first model turn that are not the model's: the environment's
        for m in msgs:
            role = str(m.get("role"))
            mine = role == "assistant"
            label = f"[{role}]" if mine or not answered else f"[{role}, from the environment]"
            answered = answered or mine
            _part(text, label, str(m.get("content") or ""), mine)
        out.append(text)
    return out


def _part(text, label: str, content: str, mine: bool, mark: str = "") -> None:
    if len(content) > MESSAGE_CHARS:
        content = f"{content[:MESSAGE_CHARS]}… ({len(content) - MESSAGE_CHARS:,} more characters)"
    text.append(f"  {label} ", style="bold cyan" if mine else "bold")
    text.append(content.replace("\n", "\n    ") + ("" if not mark else " "))
    if mark:
        text.append(mark, style="bold red")
    text.append("\n")


def _as_seen(text, row: dict, msgs: list, ids: list[int], mask: list[int], seen: Seen) -> None:
    """The row as the model saw it (see `conversations`): the prompt's messages when they are its prompt text,
    else the prompt as rendered (a chat template's, or a row continued from an earlier one), then the completion's
    runs decoded from their tokens."""
    tok = seen.tokenizer
    first = next((k for k, m in enumerate(msgs) if m.get("role") == "assistant"), len(msgs))
    if "".join(str(m.get("content") or "") for m in msgs[:first]) == row.get("prompt"):
        for m in msgs[:first]:
            _part(text, f"[{m.get('role')}]", str(m.get("content") or ""), False)
    else:
        _part(text, "[prompt, as rendered]", str(row.get("prompt") or ""), False)
    before = row.get("observation_tokens")  # each observation's tokens before the cut, where the row records them
    if isinstance(before, list):  # an empty observation appends no run of tokens
        before = [n for n in before if not isinstance(n, int) or n > 0]
    k = 0
    for mine, seg in segments(ids, mask):
        if mine:
            _part(text, "[assistant]", tok.decode(seg, skip_special_tokens=True), True)
            continue
        mark = ""
        if isinstance(before, list) and k < len(before) and isinstance(before[k], int) and before[k] > len(seg):
            mark = f"[cut at {len(seg)} tokens]"
        elif not isinstance(before, list) and seen.max_env_tokens and len(seg) == seen.max_env_tokens:
            mark = f"[{len(seg)} tokens: --max-env-tokens, it may have been cut at {len(seg)} tokens]"
        _part(text, "[environment, as appended]", tok.decode(seg, skip_special_tokens=False), False, mark)
        k += 1
