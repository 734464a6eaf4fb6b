"""The turn loop: an engine samples, an environment answers, until every trajectory of the batch has ended.

`sample` is one turn for a batch of prompts (what single-turn stages run): the engine's `Generated`, nothing
else. `run_episodes` runs `Prompts` against an environment (`rlkit.envs`): every trajectory of the batch is
sampled together, turn by turn (the active ones only, one engine call per turn, never one trajectory at a time),
and each becomes one row.

The token rule. A trajectory is the prompt's tokens, then, turn after turn, the tokens the engine sampled
(`loss_mask` 1, with the engine's log-probs) and the tokens of the environment's observation (`loss_mask` 0,
log-prob 0.0), concatenated as tokens: nothing is ever re-tokenised from text, so what update trains on is exactly
what was sampled. A text observation is appended as the tokenizer's encoding of that text (no special tokens). A
chat-message observation is rendered through the chat template and only the new suffix is tokenised: the suffix
is what the template's rendering of the whole conversation adds after the trajectory's own text; where the
template would render the earlier turns differently (some templates drop earlier reasoning), the trajectory is cut
into a new sample there rather than altered: the row so far ends (`end_reason` "continued"), and the trajectory
goes on in a new row whose prompt is the template's rendering of the whole conversation (prime-rl's rule). Every
row of a trajectory has its group and sample index and the trajectory's reward; `turns`, `turn_rewards` and
`token_rewards` (each step's reward at its turn's last sampled token) are the row's own, `tool_calls` is on the
trajectory's last row. A tokenizer without a chat
template renders a message as `<ROLE>content</ROLE>` (a tool result: `<tool>408</tool>`).

Limits: `max_turns` model turns; `max_new_tokens` per turn; `max_total_tokens` completion tokens over all turns
(and never past the model's context); `max_env_tokens` per observation, of which the first are kept (the end is
cut). A limit reached is `truncated`, not a loss. Each `reset`/`step` call may run `env_timeout` seconds (0: no
limit; a real-time timer, as `--reward-timeout`). An environment that raises, returns a bad value (a reward that
is not a finite number, an observation that is neither text nor messages or longer than
`MAX_OBSERVATION_CHARS`) or overruns is one line (`EnvError`, exit 2) naming the class, the method and the
trajectory; with `env_errors="end"` the trajectory ends there instead, with reward 0 and `end_reason` "error:
...". `close()` is called on every instance, also after an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlkit.engines.base import Generated
from rlkit.envs.base import EnvError, as_step, check_observation


@dataclass(frozen=True)
class Sampling:
    """The sampling options every sampling stage shares (`rlkit.options`' Sampling panel)."""

    n: int = 1  # samples (trajectories) per prompt
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 16  # per turn
    max_turns: int = 8
    max_total_tokens: int | None = None  # completion tokens over all turns; None: the model's context
    max_env_tokens: int = 256  # tokens of one observation appended
    env_timeout: float = 60.0  # seconds per reset/step call; 0: no limit
    env_errors: str = "fail"  # fail | end
    # the sampled tokens' log-probs (`sample`): the hf engine keeps a batch's logits for them; greedy evaluation,
    # which reads none, turns them off
    logprobs: bool = True


@dataclass(frozen=True)
class Prompts:
    """One batch of prompts: prompt c0 + i of the run is row i (its seed and group ids follow c0)."""

    c0: int
    ids: list[str]
    answers: list[str | None]
    texts: list[str]
    prompt_ids: list[list[int]]
    splits: list[str] | None = None  # each prompt's split (for the environment's Example); None: train


def sample(engine, prompts: Prompts, s: Sampling, seed: int, stop: Sequence[str] = (), ticker=None) -> Generated:
    """One turn: `s.n` completions of each prompt (row i*n + j is sample j of prompt i), seeded `seed`."""
    hf = getattr(engine, "name", "") == "hf"
    kw = {"ticker": ticker} if ticker is not None and hf else {}
    if hf and not s.logprobs:
        kw["logprobs"] = False
    gen = engine.sample(prompts.prompt_ids, n=s.n, temperature=s.temperature, top_p=s.top_p,
                        max_new_tokens=s.max_new_tokens, seed=seed, **({"stop": tuple(stop)} if stop else {}), **kw)
    if ticker is not None and "ticker" not in kw:
        ticker.advance(len(prompts.prompt_ids))
    return gen


@dataclass
class _Traj:
    prompt_id: str
    sample: int
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    finish: str = "length"
    terminated: bool = False
    truncated: bool = False
    end_reason: str | None = None  # None while active
    error: bool = False
    last_action: str = ""
    tool_calls: int = 0
    ends: list[int] = field(default_factory=list)  # each turn's last sampled token in `ids` (the row's)
    spent: bool = False  # the completion budget is used up: the environment judges the last turn, then it ends
    env: Any = None  # this trajectory's environment instance
    done: list = field(default_factory=list)  # rows already cut off the trajectory (the template rewrote history)
    all_rewards: list[float] = field(default_factory=list)  # every step's reward, over all its rows

    @property
    def label(self) -> str:
        return f"prompt {self.prompt_id!r} sample {self.sample}"


@dataclass
class Episodes:
    """A batch's trajectories as rollouts-table columns (row i*n + j: trajectory j of prompt i)."""

    columns: dict[str, list]
    final: list[str]  # each row's trajectory's last model turn (what a task's verifier scores)
    finish_reasons: list[str]
    # the trajectory of each row (k: sample k % n of prompt k // n); a trajectory whose chat template rewrote its
    # history has more than one row
    trajectory: list[int]
    # run_episodes(keep_open=True): each row's environment instance, alive until `close()` (for a reward function
    # that reads it)
    instances: list = field(default_factory=list)
    closer: Any = None

    def close(self, failure: BaseException | None = None) -> None:
        """Close the instances `run_episodes(keep_open=True)` left open (nothing otherwise); a failing close() is
        one line, unless `failure` is already raising."""
        closer, self.closer = self.closer, None
        if closer is not None:
            closer(failure)


def run_episodes(engine, tokenizer, env, prompts: Prompts, s: Sampling, seed: int, ticker=None,
                 keep_open: bool = False) -> Episodes:
    """Run `s.n` trajectories of each prompt against fresh instances of `env` (an `rlkit.envs.EnvSpec`). With
    `keep_open` the instances are closed by the returned `Episodes.close()` instead (after an error: at once)."""
    from rlkit.tasks.base import Example
    from rlkit.tasks.reward_fns import _alarm_handler

    n, P = s.n, len(prompts.ids)
    trajs = [_Traj(prompts.ids[k // n], k % n) for k in range(P * n)]
    instances: list[Any] = []
    stop = tuple(env.attribute("stop", ()) or ())
    context = getattr(engine, "context", None)
    failure: BaseException | None = None
    try:
        with _alarm_handler(s.env_timeout) as limit:
            call = _Caller(env.name, limit, s.env_errors)
            for k, t in enumerate(trajs):
                inst = t.env = env.make()
                instances.append(inst)
                p = k // n
                ex = Example(prompts.ids[p], prompts.texts[p], prompts.answers[p],
                             prompts.splits[p] if prompts.splits else "train")
                obs = call(t, "reset", lambda inst=inst, ex=ex: inst.reset(ex), check=_reset_check)
                if t.end_reason is None:
                    _start(t, tokenizer, obs, context, env.name)
            turn = 0
            while True:
                active = [t for t in trajs if t.end_reason is None]
                if not active:
                    break
                turn += 1
                # 31 bits: the hf engine seeds torch with seed * 1_000_003 + batch, which must stay in 64 bits
                gen = engine.sample([t.prompt_ids + t.ids for t in active], n=1, temperature=s.temperature,
                                    top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                                    seed=(seed * 1_000_003 + turn) % (2**31 - 1), **({"stop": stop} if stop else {}))
                for t, ids, lps, fin in zip(active, gen.completion_ids, gen.logprobs or [None] * len(active),
                                            gen.finish_reasons, strict=True):
                    _take_turn(t, tokenizer, ids, lps, fin, s, context)
                for t in active:  # the environment judges every turn (even one the budget cut)
                    st = call(t, "step", lambda t=t: t.env.step(t.last_action), check=as_step)
                    if t.end_reason is not None:
                        continue  # the call failed and env_errors="end" ended it
                    t.rewards.append(st.reward)
                    t.all_rewards.append(st.reward)
                    if st.terminated or st.truncated:
                        t.terminated, t.truncated = st.terminated, st.truncated
                        t.end_reason = "terminated" if st.terminated else "truncated"
                    elif st.observation is None:
                        t.end_reason = _fail(t, call, "step", "returned no observation for an episode that goes on "
                                                              "(neither terminated nor truncated)")
                    elif t.turns >= s.max_turns:
                        t.truncated, t.end_reason = True, "max_turns"
                    else:
                        _observe(t, tokenizer, st.observation, s, context)
                for t in active:
                    if t.end_reason is not None and ticker is not None:
                        ticker.advance(1)
                    calls = getattr(t.env, "tool_calls", 0)
                    t.tool_calls = calls if isinstance(calls, int) else 0
    except BaseException as e:  # noqa: BLE001 (re-raised after the instances are closed)
        failure = e
        raise
    finally:
        if failure is not None or not keep_open:
            _close_all(instances, env.name, failure)
    ep = _columns(trajs)
    if keep_open:
        ep.instances = [trajs[k].env for k in ep.trajectory]
        ep.closer = lambda failure: _close_all(instances, env.name, failure)
    return ep


class _Caller:
    """Calls an environment's method under the time limit; a failure is one line, or (env_errors="end") ends
    the trajectory with reward 0 and the reason."""

    def __init__(self, name: str, limit: float, policy: str) -> None:
        self.name, self.limit, self.policy = name, limit, policy

    def __call__(self, t: _Traj, method: str, fn, check=None):
        import signal

        from rlkit.errors import RlkitError
        from rlkit.tasks.reward_fns import TimedOut
        from rlkit.tasks.user_code import one_line

        where = f"environment {self.name}: {method}()"
        try:
            if self.limit:
                signal.setitimer(signal.ITIMER_REAL, self.limit)
            try:
                value = fn()
            finally:
                if self.limit:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            return check(value, f"{where} on {t.label}") if check else value
        except TimedOut:
            why = f"did not return within {self.limit:g} s"
            return self.fail(t, method, why, f"{where} did not return within {self.limit:g} s on {t.label}; raise "
                             "--env-timeout (0: no limit) or fix the environment")
        except EnvError as e:  # the check's, or the environment's own (an adapter's: a server's error): the row named
            line = str(e) if t.label in str(e) else f"{e} on {t.label}"
            return self.fail(t, method, str(e).split(" returned ", 1)[-1], line)
        except RlkitError:
            raise
        except Exception as e:
            return self.fail(t, method, f"raised {one_line(e)}", f"{where} raised {one_line(e)} on {t.label}")

    def fail(self, t: _Traj, method: str, why: str, line: str):
        if self.policy != "end":
            raise EnvError(line + ("" if "--env-errors" in line else " (--env-errors end: end such trajectories with "
                                                                    "reward 0 instead)"))
        t.end_reason = f"error: {method} {why}"[:300]
        t.error = True
        return None


def _fail(t: _Traj, call: _Caller, method: str, why: str) -> str | None:
    call.fail(t, method, why, f"environment {call.name}: {method}() {why} on {t.label}")
    return t.end_reason


def _reset_check(obs, where: str):
    check_observation(obs, where)
    return obs


def _start(t: _Traj, tokenizer, obs, context: int | None, name: str) -> None:
    """The prompt from `reset`'s observation: text with the tokenizer's special tokens, or messages through the
    chat template (with the generation prompt)."""
    from rlkit.errors import RlkitError

    if isinstance(obs, str):
        t.prompt_text = obs
        t.prompt_ids = list(tokenizer(obs, add_special_tokens=True)["input_ids"])
        t.messages = [{"role": "user", "content": obs}]
    else:
        msgs = [{"role": m["role"], "content": m["content"]} for m in obs]
        if getattr(tokenizer, "chat_template", None):
            t.prompt_text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                                          **_tools(t.env))
            t.prompt_ids = list(tokenizer(t.prompt_text, add_special_tokens=False)["input_ids"])
        else:
            t.prompt_text = "".join(_plain(m) for m in msgs)
            t.prompt_ids = list(tokenizer(t.prompt_text, add_special_tokens=True)["input_ids"])
        t.messages = msgs
    if context is not None and len(t.prompt_ids) >= context:
        raise RlkitError(f"environment {name}: reset()'s prompt for {t.label} is {len(t.prompt_ids)} tokens; the "
                         f"model's context is {context}, with no room left to generate")


def tool_schemas(env) -> list | None:
    """An environment's tool schemas for the chat template (its optional `tool_schemas()`: a TRL environment class's
    tools), or None."""
    fn = getattr(env, "tool_schemas", None)
    schemas = fn() if callable(fn) else None
    return list(schemas) if schemas else None


def _tools(env) -> dict:
    schemas = tool_schemas(env)
    return {"tools": schemas} if schemas else {}


def _plain(m: dict) -> str:
    return f"<{m['role']}>{m['content']}</{m['role']}>"


def _budget(t: _Traj, s: Sampling, context: int | None) -> int:
    """Completion tokens the trajectory may hold in all."""
    cap = s.max_total_tokens if s.max_total_tokens is not None else 1 << 62
    if context is not None:
        cap = min(cap, context - len(t.prompt_ids))
    return cap


def _room_left(t: _Traj, s: Sampling, context: int | None) -> int:
    return _budget(t, s, context) - len(t.ids)


def _take_turn(t: _Traj, tokenizer, ids: list[int], lps, fin: str, s: Sampling, context: int | None) -> None:
    """Append the tokens the engine sampled for this turn (cut at the trajectory's budget); `spent`: no room is
    left for another turn (the environment still judges this one)."""
    room = _room_left(t, s, context)
    cut = len(ids) > room
    if cut:
        ids, fin = ids[:room], "length"
        lps = lps[:room] if lps is not None else None
    t.ids += ids
    t.mask += [1] * len(ids)
    t.logprobs += list(lps) if lps is not None else [0.0] * len(ids)
    t.ends.append(len(t.ids) - 1)
    t.turns += 1
    t.finish = fin
    t.last_action = tokenizer.decode(ids, skip_special_tokens=True)
    t.messages.append({"role": "assistant", "content": t.last_action})
    t.spent = _room_left(t, s, context) <= 0


def _observe(t: _Traj, tokenizer, obs, s: Sampling, context: int | None) -> None:
    """Append the observation's tokens (mask 0): text as its encoding, messages as the chat template's new suffix."""
    if t.spent:
        t.truncated, t.end_reason = True, "max_total_tokens"
        return
    if isinstance(obs, str):
        toks = list(tokenizer(obs, add_special_tokens=False)["input_ids"])
        t.messages.append({"role": "user", "content": obs})
    else:
        msgs = [{"role": m["role"], "content": m["content"]} for m in obs]
        if getattr(tokenizer, "chat_template", None):
            before = tokenizer.decode(t.prompt_ids + t.ids, skip_special_tokens=False)
            history = [*t.messages, *msgs]
            full = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False, **_tools(t.env))
            if not full.startswith(before):
                _new_sample(t, tokenizer, full, msgs, s, context)
                return
            toks = list(tokenizer(full[len(before):], add_special_tokens=False)["input_ids"])
        else:
            toks = list(tokenizer("".join(_plain(m) for m in msgs), add_special_tokens=False)["input_ids"])
        t.messages += msgs
    toks = toks[:s.max_env_tokens]
    room = _room_left(t, s, context)
    if len(toks) >= room:  # no room for the observation and another turn
        t.truncated, t.end_reason = True, "max_total_tokens"
        return
    t.ids += toks
    t.mask += [0] * len(toks)
    t.logprobs += [0.0] * len(toks)


def _new_sample(t: _Traj, tokenizer, full: str, msgs: list[dict], s: Sampling, context: int | None) -> None:
    """The chat template renders the conversation's earlier turns otherwise than they were sampled: close the
    trajectory's row here and go on in a new one whose prompt is the template's rendering of all of it."""
    t.done.append(_Row(t.prompt_text, t.prompt_ids, t.ids, t.mask, t.logprobs, t.rewards, t.turns, t.finish,
                       [*t.messages, *msgs], t.ends))
    t.messages += msgs
    t.prompt_text, t.prompt_ids = full, list(tokenizer(full, add_special_tokens=False)["input_ids"])
    t.ids, t.mask, t.logprobs, t.rewards, t.turns, t.ends = [], [], [], [], 0, []
    if _room_left(t, s, context) <= 0:
        t.truncated, t.end_reason = True, "max_total_tokens"


@dataclass(frozen=True)
class _Row:
    """A row cut off a trajectory (see `_new_sample`)."""

    prompt_text: str
    prompt_ids: list[int]
    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    rewards: list[float]
    turns: int
    finish: str
    messages: list[dict]
    ends: list[int]  # each turn's last sampled token in `ids`


def _close_all(instances: list, name: str, failure: BaseException | None) -> None:
    """`close()` every instance that has one; the first failure is one line, unless one is already raising."""
    from rlkit.tasks.user_code import one_line

    first = None
    for inst in instances:
        close = getattr(inst, "close", None)
        if callable(close):
            try:
                close()
            except Exception as e:  # noqa: BLE001
                first = first or e
    if first is not None and failure is None:
        raise EnvError(f"environment {name}: close() raised {one_line(first)}") from first


def _columns(trajs: list[_Traj]) -> Episodes:
    """The rows: each trajectory's rows cut off (`_new_sample`), then its last, in order. `token_rewards`: each
    step's reward at its turn's last sampled token (a share of `reward/env`); all 0 for a trajectory an error ended."""
    from rlkit.tasks.multi_turn import turn_token_rewards

    names = ("prompt_id", "sample_idx", "prompt", "prompt_ids", "completion_ids", "old_logprobs", "finish_reason",
             "loss_mask", "turns", "turn_rewards", "terminated", "truncated", "end_reason", "tool_calls", "messages",
             "reward/env", "token_rewards")
    cols: dict[str, list] = {k: [] for k in names}
    index, final, fins = [], [], []
    for k, t in enumerate(trajs):
        reward = 0.0 if t.error else float(sum(t.all_rewards))
        last = _Row(t.prompt_text, t.prompt_ids, t.ids, t.mask, t.logprobs, t.rewards, t.turns, t.finish, t.messages,
                    t.ends)
        for r in [*t.done, last]:
            is_last = r is last
            vals = (t.prompt_id, t.sample, r.prompt_text, r.prompt_ids, r.ids, r.logprobs, r.finish, r.mask, r.turns,
                    r.rewards, t.terminated and is_last, (t.truncated or not t.terminated) and is_last,
                    t.end_reason if is_last else "continued",
                    t.tool_calls if is_last else 0, r.messages, reward,
                    turn_token_rewards(len(r.ids), [] if t.error else r.ends, r.rewards))
            for name, v in zip(names, vals, strict=True):
                cols[name].append(v)
            index.append(k)
            final.append(t.last_action)
            fins.append(r.finish)
    return Episodes(cols, final, fins, index)
