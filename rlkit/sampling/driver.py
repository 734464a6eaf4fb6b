"""The turn loop: an engine samples, an environment answers, until every trajectory of the batch has ended.

`sample` is one turn for a batch of prompts (what single-turn stages run): the engine's `Generated`, nothing
else. `run_episodes` runs `Prompts` against an environment (`rlkit.envs`): the trajectories of the batch are
sampled together, never one trajectory at a time, and each becomes one row.

Concurrency. The environment's calls (`reset`, `step`, `close`) of different trajectories run at once
(`rlkit.sampling.env_calls`: `env_workers` threads, an event loop for `async def`), never two of one trajectory;
this thread owns the trajectories and the engine. `env_schedule` "turns": one engine call per turn over every
running trajectory, once the environment has answered them all (the rows do not depend on the calls' latencies or
order); "ready": each trajectory's next turn goes to the engine's `Stream` as soon as its own call returned (vLLM:
continuous batching; another engine: the ready ones as one batch whenever the engine is free), seeded by
`trajectory_seed` (seed, prompt, sample, turn). An environment with `max_sessions` has at most that many instances
open: the others queue, a trajectory's instance is closed as soon as it ends, and a `Busy` reset is tried again.

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

Credit. An environment instance's `credit` attribute says which turns a trajectory's rewards train. "all" (or no
attribute): every turn, with the trajectory's reward. "final": only the final turn; when the trajectory ends the
earlier turns' tokens get `loss_mask` 0 (as the observations' have) and the rows cut off before its last are left
out (they hold earlier turns only). "turn": every turn with its own step's reward; the trajectory becomes one row
a turn (its last row's turns; the rows cut off before are left out), row k the conversation up to turn k with only
that turn's tokens trained and `reward/env` that step's reward (`turn_rewards` and `token_rewards` hold it alone),
so a group's baseline is taken over turns: a first attempt is judged as single-turn RL judges it, and a later
attempt by what it did with the feedback.

Limits: `max_turns` model turns; `max_new_tokens` per turn; `max_total_tokens` completion tokens over all turns
(and never past the model's context); `max_env_tokens` per observation, of which the first are kept (the end is
cut). A limit reached is `truncated`, not a loss. Each `reset`/`step`/`close` call may run `env_timeout` seconds
(0: no limit; from its start, enforced by `env_calls`' watchdog, off this thread). An environment that raises (or
calls sys.exit()), returns a bad value (a reward that is not a finite number, an observation that is neither text
nor messages or longer than `MAX_OBSERVATION_CHARS`) or overruns is one line (`EnvError`, exit 2) naming the class,
the method and the trajectory; with `env_errors="end"` the trajectory ends there instead, with reward 0 and
`end_reason` "error: ...". `close()` is called on every instance, also after an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from rlkit.engines.base import CONSERVATIVE, Generated
from rlkit.envs.base import EnvError, as_step, check_observation, failure_line, prompt_too_long


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
    env_timeout: float = 60.0  # seconds per environment call (reset, step, close); 0: no limit
    env_errors: str = "fail"  # fail | end
    env_workers: int = 32  # environment calls of different trajectories at once (threads); 1: one at a time, in order
    env_schedule: str = "auto"  # turns | ready | auto (ready on vllm, turns elsewhere): see run_episodes
    # the sampled tokens' log-probs (`sample`): the hf engine keeps a batch's logits for them; greedy evaluation,
    # which reads none, turns them off on an engine that can (`Capabilities.optional_logprobs`)
    logprobs: bool = True

    @classmethod
    def of(cls, cfg: Any, **settings: Any) -> Sampling:
        """The driver's options from a stage config: each of its fields named as one of these (--n, --temperature,
        --top-p, --max-new-tokens and the environment's, `rlkit.options.EnvFlags`), then `settings`."""
        own = {f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)}
        return cls(**{**own, **settings})


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
    can = getattr(engine, "capabilities", CONSERVATIVE)
    kw = {"ticker": ticker} if ticker is not None and can.streams_tickers else {}
    if can.optional_logprobs and not s.logprobs:
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
    observed: list[int] = field(default_factory=list)  # each observation appended to the row: its tokens before the cut
    unknown: int = 0  # observations whose encoding holds the tokenizer's unknown token
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
    env_wait: float = 0.0  # seconds the turn loop waited on the environment with nothing to sample
    # the trajectories (their labels) an observation of which the tokenizer could only encode with its unknown token
    unknown: list[str] = field(default_factory=list)
    # each trajectory's reward (its steps' sum; 0 when an error ended it): a row's `reward/env` is this, or under
    # `credit="turn"` its own turn's
    rewards: list[float] = field(default_factory=list)

    def close(self, failure: BaseException | None = None) -> None:
        """Close the instances `run_episodes(keep_open=True)` left open (nothing otherwise); a failing close() is
        one line, unless `failure` is already raising."""
        closer, self.closer = self.closer, None
        if closer is not None:
            closer(failure)


def run_episodes(engine, tokenizer, env, prompts: Prompts, s: Sampling, seed: int, ticker=None,
                 keep_open: bool = False) -> Episodes:
    """Run `s.n` trajectories of each prompt against fresh instances of `env` (an `rlkit.envs.EnvSpec`). With
    `keep_open` the instances still open at the end (all of them, unless the environment holds sessions: those close
    as their trajectories end) are closed by the returned `Episodes.close()` instead (after an error: at once)."""
    loop = _Loop(engine, tokenizer, env, prompts, s, seed, ticker)
    failure: BaseException | None = None
    try:
        loop.run()
    except BaseException as e:  # noqa: BLE001 (re-raised after the instances are closed)
        failure = e
        raise
    finally:
        if failure is not None or not keep_open:
            loop.finish(failure)
    ep = _columns(loop.trajs)
    ep.env_wait = loop.env_wait
    if keep_open:
        ep.instances = [loop.trajs[k].env for k in ep.trajectory]
        ep.closer = loop.finish
    return ep


def schedule(engine, asked: str) -> str:
    """`--env-schedule`: "turns" or "ready" as asked; auto: ready on an engine with continuous batching (vLLM,
    `Capabilities.continuous_batching`), turns elsewhere."""
    if asked in ("turns", "ready"):
        return asked
    return "ready" if getattr(engine, "capabilities", CONSERVATIVE).continuous_batching else "turns"


def session_cap(env, workers: int) -> int | None:
    """How many instances of `env` may be open at once: its `max_sessions` (True: `workers`); None: no cap."""
    v = env.attribute("max_sessions")
    if v is True:
        return max(1, workers)
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    return None


def trajectory_seed(seed: int, k: int, n: int, request: int) -> int:
    """The seed of trajectory k's `request`-th engine request (k: sample k % n of prompt k // n) under
    `--env-schedule ready`: (seed, prompt, sample, turn), well spread over 31 bits."""
    import hashlib

    h = hashlib.blake2b(f"{seed}:{k // n}:{k % n}:{request}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % (2**31 - 2**16)


class _Loop:
    """One batch's trajectories, each through its states: queued for a session, resetting, ready, sampling, stepping,
    ended (the module docstring's "Concurrency"). The environment's calls run in `EnvCalls` (threads, an event
    loop); the engine gets the ready trajectories a whole turn at a time ("turns") or one by one ("ready")."""

    def __init__(self, engine, tokenizer, env, prompts: Prompts, s: Sampling, seed: int, ticker) -> None:
        from collections import deque

        from rlkit.sampling.env_calls import EnvCalls

        self.engine, self.tokenizer, self.env, self.prompts, self.s, self.seed = engine, tokenizer, env, prompts, s, seed
        self.ticker = ticker
        n = s.n
        self.trajs = [_Traj(prompts.ids[k // n], k % n) for k in range(len(prompts.ids) * n)]
        self.stop = tuple(env.attribute("stop", ()) or ())
        self.context = getattr(engine, "context", None)
        self.mode = schedule(engine, s.env_schedule)
        self.cap = session_cap(env, s.env_workers)
        self.calls = EnvCalls(s.env_workers, s.env_timeout)
        self.call = _Caller(env.name, s.env_timeout, s.env_errors)
        self.queue = deque(range(len(self.trajs)))  # waiting for a session (without a cap: all of them, at once)
        self.open: dict[int, Any] = {}  # trajectory -> its instance, made and not yet closed
        self.sessions = 0  # instances open and not given back (a reset refused as Busy gives its session back)
        self.remaining = len(self.trajs)  # trajectories not yet ended
        self.ready: list[int] = []  # trajectories whose next turn is to be sampled
        self.requests = [0] * len(self.trajs)  # engine requests so far, per trajectory (its seed's turn)
        self.busy_since: dict[int, float] = {}
        self.retry_at = 0.0  # a reset was refused as Busy: the next one not before this (time.monotonic)
        self.turn = 0  # engine calls ("turns")
        self.stream = None  # the engine's Stream ("ready")
        self.env_wait = 0.0  # seconds the loop waited on the environment with nothing to sample

    def run(self) -> None:
        while self.remaining or self.calls.in_flight:
            self._admit()
            if self.mode == "turns":  # every call answered before the next turn: the order stays the same
                if self.calls.in_flight:
                    done = []
                    while self.calls.in_flight:
                        done += self._wait()
                    self._handle(sorted(done, key=lambda d: d.key))
                elif self.ready:
                    self._sample_turn()
                else:
                    self._idle()
                continue
            self._handle(self.calls.poll())
            self._admit()
            self._submit_ready()
            if self.stream.pending:
                for k, ids, lps, fin in self.stream.poll():
                    self._taken(k, ids, lps, fin)
            elif self.calls.in_flight:
                self._handle(self._wait())
            else:
                self._idle()

    def _wait(self) -> list:
        """The environment calls that finish next, waited for with nothing to sample (`env_wait` counts it)."""
        import time

        t0 = time.monotonic()
        try:
            return self.calls.wait()
        finally:
            self.env_wait += time.monotonic() - t0

    # -- sessions ------------------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Reset the queued trajectories there are sessions for (all of them without a cap)."""
        import time

        from rlkit.tasks.base import Example

        if self.queue and self.retry_at and time.monotonic() < self.retry_at:
            return
        while self.queue and (self.cap is None or self.sessions < self.cap):
            k = self.queue.popleft()
            t = self.trajs[k]
            if t.env is None:
                t.env = self.open[k] = self.env.make()
            self.sessions += 1
            p, pr = k // self.s.n, self.prompts
            ex = Example(pr.ids[p], pr.texts[p], pr.answers[p], pr.splits[p] if pr.splits else "train")
            self.calls.submit(k, "reset", t.env.reset, ex)

    def _idle(self) -> None:
        """Nothing to sample and no call running: a reset refused as Busy waits for its retry."""
        import time

        if not self.queue or not self.retry_at:
            raise RuntimeError("the turn loop has nothing to wait for")  # a bug of the loop's, never the user's
        time.sleep(max(0.0, self.retry_at - time.monotonic()))
        self.retry_at = 0.0

    def _ended(self, k: int) -> None:
        self.remaining -= 1
        if self.ticker is not None:
            self.ticker.advance(1)
        if self.cap is not None:  # its session goes back at once, to the next trajectory in the queue
            self._close(k)

    def _close(self, k: int) -> None:
        inst = self.open.pop(k, None)
        close = getattr(inst, "close", None)
        if callable(close):
            self.calls.submit(k, "close", close)
        else:
            self.sessions -= 1

    # -- the engine ----------------------------------------------------------------------------------------------------
    def _sample_turn(self) -> None:
        """"turns": one engine call for every ready trajectory (all that are running), then their steps."""
        s = self.s
        active = sorted(self.ready)
        self.ready = []
        trajs = [self.trajs[k] for k in active]
        self.turn += 1
        # 31 bits: the hf engine seeds torch with seed * 1_000_003 + batch, which must stay in 64 bits
        gen = self.engine.sample([t.prompt_ids + t.ids for t in trajs], n=1, temperature=s.temperature, top_p=s.top_p,
                                 max_new_tokens=s.max_new_tokens, seed=(self.seed * 1_000_003 + self.turn) % (2**31 - 1),
                                 **({"stop": self.stop} if self.stop else {}))
        for t, ids, lps, fin in zip(trajs, gen.completion_ids, gen.logprobs or [None] * len(trajs), gen.finish_reasons,
                                    strict=True):
            _take_turn(t, self.tokenizer, ids, lps, fin, s, self.context)
        for k, t in zip(active, trajs, strict=True):  # the environment judges every turn (even one the budget cut)
            self.calls.submit(k, "step", t.env.step, t.last_action)

    def _submit_ready(self) -> None:
        """"ready": each ready trajectory's next turn goes to the engine's stream at once, with its own seed."""
        from rlkit.engines.base import stream

        s = self.s
        if self.stream is None:
            self.stream = stream(self.engine, temperature=s.temperature, top_p=s.top_p,
                                 max_new_tokens=s.max_new_tokens, stop=self.stop)
        for k in sorted(self.ready):
            t = self.trajs[k]
            self.stream.submit(k, t.prompt_ids + t.ids, trajectory_seed(self.seed, k, s.n, self.requests[k]))
            self.requests[k] += 1
        self.ready = []

    def _taken(self, k: int, ids, lps, fin: str) -> None:
        t = self.trajs[k]
        _take_turn(t, self.tokenizer, ids, lps, fin, self.s, self.context)
        self.calls.submit(k, "step", t.env.step, t.last_action)

    # -- the environment's answers -------------------------------------------------------------------------------------
    def _handle(self, done: list) -> None:
        for d in done:
            t = self.trajs[d.key]
            if d.method == "close":
                self._closed(d)
            elif d.method == "reset":
                self._reset(t, d)
            else:
                self._step(t, d)

    def _reset(self, t: _Traj, d) -> None:
        import time

        from rlkit.envs.base import Busy

        if isinstance(d.error, Busy):  # no session free (a server at capacity): queued again, first
            now = time.monotonic()
            if now - self.busy_since.setdefault(d.key, now) < d.error.wait:
                self.sessions -= 1
                if self.cap is None:  # sessions are a resource after all: the ended trajectories give theirs back
                    for k in [k for k in self.open if self.trajs[k].end_reason is not None]:
                        self._close(k)
                waiting = set(self.queue)
                held = sum(1 for k in self.open if k != d.key and k not in waiting and self.trajs[k].end_reason is None)
                self.cap = max(1, held)  # as many as it holds for us now
                self.queue.appendleft(d.key)
                self.retry_at = now + 0.25
                return
        obs = self.call(t, "reset", d, check=_reset_check)
        if t.end_reason is None:
            _start(t, self.tokenizer, obs, self.context, self.env)
            self.ready.append(d.key)
        else:
            self._ended(d.key)

    def _step(self, t: _Traj, d) -> None:
        s = self.s
        st = self.call(t, "step", d, check=as_step)
        if t.end_reason is None:  # else the call failed and env_errors="end" ended it
            t.rewards.append(st.reward)
            t.all_rewards.append(st.reward)
            if st.terminated or st.truncated:
                t.terminated, t.truncated = st.terminated, st.truncated
                t.end_reason = "terminated" if st.terminated else "truncated"
            elif st.observation is None:
                t.end_reason = _fail(t, self.call, "step", "returned no observation for an episode that goes on "
                                                           "(neither terminated nor truncated)")
            elif t.turns >= s.max_turns:
                t.truncated, t.end_reason = True, "max_turns"
            else:
                _observe(t, self.tokenizer, st.observation, s, self.context)
        calls = getattr(t.env, "tool_calls", 0)
        t.tool_calls = calls if isinstance(calls, int) else 0
        if t.end_reason is None:
            self.ready.append(d.key)
        else:
            self._ended(d.key)

    def _closed(self, d) -> None:
        self.sessions -= 1
        if d.error is not None:
            raise _close_error(self.env.name, d.error, self.s.env_timeout)

    # -- the end -------------------------------------------------------------------------------------------------------
    def finish(self, failure: BaseException | None) -> None:
        """`close()` every instance still open (at once), also after an error: the first failure is one line, unless
        one is already raising. A failing stage first gives up the calls still running."""
        if failure is not None:
            self.calls.cancel_all()
            if self.stream is not None:
                self.stream.abort()
        try:
            for k in sorted(self.open):
                close = getattr(self.open[k], "close", None)
                if callable(close):
                    self.calls.submit(k, "close", close)
            self.open.clear()
            done = []
            while self.calls.in_flight:
                done += self.calls.wait()
            errors = sorted((d for d in done if d.method == "close" and d.error is not None), key=lambda d: d.key)
            if errors and failure is None:
                raise _close_error(self.env.name, errors[0].error, self.s.env_timeout)
        finally:
            self.calls.shutdown()


def _close_error(name: str, e: BaseException, limit: float) -> EnvError:
    from rlkit.plugins.user_code import one_line
    from rlkit.sampling.env_calls import Overrun

    if isinstance(e, Overrun):
        return EnvError(f"environment {name}: close() did not return within {limit:g} s; raise --env-timeout (0: no "
                        "limit) or fix the environment")
    if isinstance(e, SystemExit):
        return EnvError(f"environment {name}: close() called {_exit_call(e)}")
    err = EnvError(f"environment {name}: close() raised {one_line(e)}")
    err.__cause__ = e
    return err


def _exit_call(e: SystemExit) -> str:
    return "sys.exit()" if e.code is None else f"sys.exit({e.code!r})"


class _Caller:
    """An environment call's outcome (`rlkit.sampling.env_calls.Done`) as its value; a failure is one line, or
    (env_errors="end") ends the trajectory with reward 0 and the reason."""

    def __init__(self, name: str, limit: float, policy: str) -> None:
        self.name, self.limit, self.policy = name, limit, policy

    def __call__(self, t: _Traj, method: str, done, check=None):
        from rlkit.errors import RlkitError
        from rlkit.plugins.user_code import one_line
        from rlkit.sampling.env_calls import Overrun

        where = f"environment {self.name}: {method}()"
        try:
            if done.error is not None:
                raise done.error
            return check(done.value, f"{where} on {t.label}") if check else done.value
        except Overrun:
            why = f"did not return within {self.limit:g} s"
            return self.fail(t, method, why, f"{where} did not return within {self.limit:g} s on {t.label}; raise "
                             "--env-timeout (0: no limit) or fix the environment")
        except SystemExit as e:  # in its thread: an environment cannot end the stage
            return self.fail(t, method, f"called {_exit_call(e)}", f"{where} called {_exit_call(e)} on {t.label}")
        except EnvError as e:  # the check's, or the environment's own (an adapter's: a server's error): the row named
            line = str(e) if t.label in str(e) else f"{e} on {t.label}"
            return self.fail(t, method, str(e).split(" returned ", 1)[-1], line, e)
        except RlkitError:
            raise
        except Exception as e:
            return self.fail(t, method, f"raised {one_line(e)}", f"{where} raised {one_line(e)} on {t.label}", e)

    def fail(self, t: _Traj, method: str, why: str, line: str, error: BaseException | None = None):
        if self.policy != "end":
            raise EnvError(failure_line(line, error))  # no --env-errors end where every trajectory would fail
        t.end_reason = f"error: {method} {why}"[:300]
        t.error = True
        return None


def _fail(t: _Traj, call: _Caller, method: str, why: str) -> str | None:
    call.fail(t, method, why, f"environment {call.name}: {method}() {why} on {t.label}")
    return t.end_reason


def _reset_check(obs, where: str):
    check_observation(obs, where)
    return obs


def _start(t: _Traj, tokenizer, obs, context: int | None, env) -> None:
    """The prompt from `reset`'s observation: text with the tokenizer's special tokens, or messages through the
    chat template (with the generation prompt)."""
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
        raise prompt_too_long(env, t.label, len(t.prompt_ids), context)


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
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and unk not in {getattr(tokenizer, a, None) for a in ("eos_token_id", "bos_token_id",
                                                                         "pad_token_id")} and unk in toks:  # text the tokenizer cannot encode: the model would see its unknown token
        t.unknown += 1
    before = len(toks)
    toks = toks[:s.max_env_tokens]
    room = _room_left(t, s, context)
    if len(toks) >= room:  # no room for the observation and another turn
        t.truncated, t.end_reason = True, "max_total_tokens"
        return
    t.observed.append(before)
    t.ids += toks
    t.mask += [0] * len(toks)
    t.logprobs += [0.0] * len(toks)


def _new_sample(t: _Traj, tokenizer, full: str, msgs: list[dict], s: Sampling, context: int | None) -> None:
    """The chat template renders the conversation's earlier turns otherwise than they were sampled: close the
    trajectory's row here and go on in a new one whose prompt is the template's rendering of all of it."""
    t.done.append(_Row(t.prompt_text, t.prompt_ids, t.ids, t.mask, t.logprobs, t.rewards, t.turns, t.finish,
                       [*t.messages, *msgs], t.ends, t.observed))
    t.messages += msgs
    t.prompt_text, t.prompt_ids = full, list(tokenizer(full, add_special_tokens=False)["input_ids"])
    t.ids, t.mask, t.logprobs, t.rewards, t.turns, t.ends, t.observed = [], [], [], [], 0, [], []
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
    observed: list[int]  # each observation appended: its tokens before the --max-env-tokens cut


CREDITS = ("all", "final", "turn")  # what an environment's `credit` may say (see the module docstring)


def credit(t: _Traj) -> str:
    """The turns of trajectory `t` its rewards train, as its environment instance says (`credit`): "all" (default),
    "final" (the last turn only) or "turn" (each turn with its own step's reward, a row each)."""
    c = getattr(t.env, "credit", "all")
    if c not in CREDITS:
        raise EnvError(f"environment {type(t.env).__name__}: credit={c!r} ({t.label}): expected "
                       + ", ".join(f"'{x}'" for x in CREDITS))
    return c


def _turn_rows(last: _Row) -> list[_Row]:
    """`credit="turn"`: row `last` as one row a turn, row k its conversation up to turn k's last sampled token with
    only turn k's tokens trained, rewarded with turn k's step reward alone; its `turns` 1 (its own turn, the last of
    its conversation: a trajectory's turns are the sum over its rows, as for rows a chat template cut)."""
    out = []
    said = [i for i, m in enumerate(last.messages) if m.get("role") == "assistant"]
    for k, end in enumerate(last.ends):
        start = last.ends[k - 1] + 1 if k else 0
        reward = last.rewards[k] if k < len(last.rewards) else 0.0
        cut = said[k] + 1 if k < len(said) else len(last.messages)
        out.append(_Row(last.prompt_text, last.prompt_ids, last.ids[:end + 1],
                        [0] * start + last.mask[start:end + 1], last.logprobs[:end + 1], [0.0] * k + [reward], 1,
                        last.finish if k == len(last.ends) - 1 else "stop", last.messages[:cut], last.ends[:k + 1],
                        last.observed[:k]))
    return out


def _columns(trajs: list[_Traj]) -> Episodes:
    """The rows: each trajectory's rows cut off (`_new_sample`), then its last, in order. `token_rewards`: each
    step's reward at its turn's last sampled token (a share of `reward/env`); all 0 for a trajectory an error ended."""
    from rlkit.tasks.multi_turn import turn_token_rewards

    names = ("prompt_id", "sample_idx", "prompt", "prompt_ids", "completion_ids", "old_logprobs", "finish_reason",
             "loss_mask", "turns", "turn_rewards", "terminated", "truncated", "end_reason", "tool_calls", "messages",
             "reward/env", "token_rewards", "observation_tokens")
    cols: dict[str, list] = {k: [] for k in names}
    index, final, fins, totals = [], [], [], []
    for k, t in enumerate(trajs):
        reward = 0.0 if t.error else float(sum(t.all_rewards))
        totals.append(reward)
        last = _Row(t.prompt_text, t.prompt_ids, t.ids, t.mask, t.logprobs, t.rewards, t.turns, t.finish, t.messages,
                    t.ends, t.observed)
        rows = [*t.done, last]
        how = credit(t)
        split = how == "turn" and not t.error and len(t.ends) > 1  # a row a turn, each with its own step's reward
        if how == "final" and any(t.mask):  # only the final turn's sampled tokens are trained
            start = t.ends[-2] + 1 if len(t.ends) > 1 else 0
            last = replace(last, mask=[0] * start + t.mask[start:])
            rows = [last]  # the rows cut off before hold earlier turns only: nothing of them to train
        elif split:
            rows = _turn_rows(last)
            last = rows[-1]
        for r in rows:
            is_last = r is last
            if split:
                reward = float(r.rewards[-1])
            vals = (t.prompt_id, t.sample, r.prompt_text, r.prompt_ids, r.ids, r.logprobs, r.finish, r.mask, r.turns,
                    r.rewards, t.terminated and is_last, (t.truncated or not t.terminated) and is_last,
                    t.end_reason if is_last else "continued",
                    t.tool_calls if is_last else 0, r.messages, reward,
                    turn_token_rewards(len(r.ids), [] if t.error else r.ends, r.rewards), r.observed)
            for name, v in zip(names, vals, strict=True):
                cols[name].append(v)
            index.append(k)
            final.append(t.last_action)
            fins.append(r.finish)
    unknown = [t.label for t in trajs if t.unknown]
    return Episodes(cols, final, fins, index, unknown=unknown, rewards=totals)
