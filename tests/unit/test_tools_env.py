"""`rlkit.envs.Tools` (calls parsed from a turn in both formats, run, answered with a result or an `error: ...`
observation, never a crash; the final answer scored) and the built-in `calc` environment and task; its tools in a
real bubblewrap sandbox; the sampling driver running CalcEnv on the real tiny model, token-exact."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit.envs import Step, get_env
from rlkit.envs import tools as tools_mod
from rlkit.envs.calc import Calc, CalcEnv, mul
from rlkit.envs.tools import Call, Tools, check_arguments, parse_call
from rlkit.errors import RlkitError
from rlkit.sandbox.bwrap import bwrap_path
from rlkit.tasks import get_task
from rlkit.tasks.base import Example, is_heldout, last_integer

needs_bwrap = pytest.mark.skipif(bwrap_path() is None and not os.environ.get("RLKIT_REQUIRE_SANDBOX"),
                                 reason="bwrap (bubblewrap) not installed; RLKIT_REQUIRE_SANDBOX unset")
EX = Example("p0", "<2*3>=", "6", "train")


# -- parsing ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "call"), [
    ("<call>mul(37, 48)</call>", Call("mul", (37, 48))),
    ("I will compute. <call>mul(37,b=48)</call>", Call("mul", (37,), {"b": 48})),
    ("<call> f(-1.5, 'a)b', [1, (2, 3)], {'k': None}, x=True) </call>",
     Call("f", (-1.5, "a)b", [1, (2, 3)], {"k": None}), {"x": True})),
    ("<call>now()</call>", Call("now")),
    ('<tool_call>\n{"name": "mul", "arguments": {"a": 37, "b": 48}}\n</tool_call>', Call("mul", (), {"a": 37, "b": 48})),
    ('<tool_call>{"name": "mul", "arguments": "{\\"a\\": 1}"}</tool_call>', Call("mul", (), {"a": 1})),  # OpenAI's string
    ('<tool_call>{"name": "mul", "arguments": [2, 3]}</tool_call>', Call("mul", (2, 3))),
    ('<tool_call>{"name": "now"}</tool_call>', Call("now")),
    # the first call of the turn counts, whichever its format
    ('<tool_call>{"name": "a"}</tool_call><call>b()</call>', Call("a")),
    ("<call>b()</call><call>c()</call>", Call("b")),
])
def test_calls_in_both_formats(text, call):
    assert parse_call(text) == call


@pytest.mark.parametrize("text", ["1776", "", "<call>mul(37, 48)", "mul(37, 48)</call>", "<tool>5</tool>",
                                  "<tool_call>{}"])
def test_a_turn_without_a_complete_call_has_none(text):
    assert parse_call(text) is None


@pytest.mark.parametrize(("text", "name", "why"), [
    ("<call>mul(37,</call>", None, "cannot parse the call 'mul(37,'"),
    ("<call>mul</call>", None, "'mul' is not a call NAME(ARGS)"),
    ("<call>a.b(1)</call>", None, "is not a call NAME(ARGS)"),
    ("<call>mul(x, 2)</call>", "mul", "argument 1 ('x') is not a Python literal"),
    ("<call>mul(2, b=10**99)</call>", "mul", "argument b ('10 ** 99') is not a Python literal"),
    ("<call>mul(*[1, 2])</call>", "mul", "*arguments are not supported"),
    ("<call>mul(**{'a': 1})</call>", "mul", "**arguments are not supported"),
    ("<call>" + "(" * 400 + "</call>", None, "cannot parse the call"),
    ("<call>f('" + "x" * 20_000 + "')</call>", None, "the call is 20,005 characters long; at most 10,000"),
    ("<tool_call>{name: mul}</tool_call>", None, "as JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', None, 'has no "name"'),
    ('<tool_call>{"name": "mul", "arguments": 3}</tool_call>', "mul", '"arguments" is a int'),
    ('<tool_call>{"name": "mul", "arguments": "{"}</tool_call>', "mul", "is not JSON"),
])
def test_unreadable_calls_say_why(text, name, why):
    c = parse_call(text)
    assert c is not None and c.name == name and why in c.error


# -- running calls --------------------------------------------------------------------------------------------------

def add(a: int, b: int = 1) -> int:
    """Add two integers."""
    return a + b


def scale(x: float, label: str | None = None) -> str:
    return f"{label or 'x'}={x!r}"


def boom() -> int:
    raise ZeroDivisionError("no")


def leave() -> None:
    raise SystemExit(3)


def flag(on: bool) -> str:
    return str(on)


def big() -> str:
    return "y" * 1500


class Exact(Tools):
    tools = [add, scale, boom, flag, big, leave]

    def score(self, answer, example):
        return float(answer.strip() == example.answer)


def _obs(step: Step) -> str:
    assert not step.terminated and not step.truncated and step.reward == 0.0
    (msg,) = step.observation
    assert msg["role"] == "tool"
    return msg["content"]


def test_a_call_answers_with_the_result_and_the_final_answer_is_scored():
    env = Exact()
    assert env.reset(EX) == "<2*3>=" and env.example is EX
    assert Exact.stop == ("</call>", "</tool_call>")
    assert _obs(env.step("<call>add(2, 3)</call>")) == "5"
    assert _obs(env.step('<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')) == "3"  # its default b
    assert _obs(env.step("<call>scale(2)</call>")) == "x=2.0"  # an int for a float: converted
    assert _obs(env.step("<call>scale(0.5, label=None)</call>")) == "x=0.5"  # a union with None
    assert _obs(env.step("<call>flag(True)</call>")) == "True"
    out = _obs(env.step("<call>big()</call>"))
    assert out == "y" * 1000 + "...[500 characters cut]"  # max_output_chars
    assert env.tool_calls == 6 and env.tool_errors == 0
    assert env.step(" 6") == Step(None, 1.0, terminated=True)
    env.reset(EX)  # a new episode starts its counts again
    assert env.tool_calls == 0 and env.step("7") == Step(None, 0.0, terminated=True)


@pytest.mark.parametrize(("action", "error"), [
    ("<call>sub(1, 2)</call>", "error: unknown tool 'sub'; tools: add, scale, boom, flag, big, leave"),
    ("<call>add()</call>", "error: add(a: int, b: int = 1) -> int: missing a required argument: 'a'"),
    ("<call>add(1, 2, 3)</call>", "error: add(a: int, b: int = 1) -> int: too many positional arguments"),
    ("<call>add(1, c=2)</call>", "error: add(a: int, b: int = 1) -> int: got an unexpected keyword argument 'c'"),
    ("<call>add('1')</call>", "error: add: argument a must be an int, got '1' (str)"),
    ("<call>add(1.0)</call>", "error: add: argument a must be an int, got 1.0 (float)"),
    ("<call>add(True)</call>", "error: add: argument a must be an int, got True (bool)"),
    ("<call>scale('2')</call>", "error: scale: argument x must be a float, got '2' (str)"),
    ("<call>scale(2, label=3)</call>", "error: scale: argument label must be a str or None, got 3 (int)"),
    ("<call>flag(1)</call>", "error: flag: argument on must be a bool, got 1 (int)"),
    ("<call>boom()</call>", "error: boom raised ZeroDivisionError: no"),
    ("<call>leave()</call>", "error: leave raised SystemExit: 3"),
    ("<call>add(1,</call>", "error: cannot parse the call 'add(1,'; expected <call>NAME(ARGS)</call> with Python "
                            "literals as arguments"),
])
def test_failures_are_error_observations_not_crashes(action, error):
    env = Exact()
    env.reset(EX)
    assert _obs(env.step(action)) == error
    assert env.tool_calls == env.tool_errors == 1
    assert _obs(env.step("<call>add(1)</call>")) == "2"  # the episode goes on


def test_tools_directly_without_a_subclass():
    env = Tools(functions=[add])
    env.reset(EX)
    assert _obs(env.step("<call>add(1, 1)</call>")) == "2"
    assert env.step("2") == Step(None, 0.0, terminated=True)  # the default score
    named = Tools(functions={"plus": add})
    named.reset(EX)
    assert _obs(named.step("<call>plus(b=4, a=1)</call>")) == "5"
    assert "Tools:\nplus(a: int, b: int = 1) -> int: Add two integers.\nCall one as <call>NAME(ARGS)</call>" in \
        named.describe()


@pytest.mark.parametrize(("functions", "error"), [
    ([lambda x: x], "tool name '<lambda>' is not an identifier"),
    ([add, add], "two tools are named 'add'"),
    ({"x": 3}, "tool 'x' is a int, not a function"),
    ("add", "tools is a str; expected a list of functions or a dict name -> function"),
])
def test_bad_tool_lists_are_one_line(functions, error):
    with pytest.raises(RlkitError, match=re.escape(error)):
        Tools(functions=functions)


def test_arguments_bind_and_check_without_annotations():
    def free(a, *rest, **kw):
        return a

    assert check_arguments(free, "free", ("s", 1), {"k": [1]}) == (("s", 1), {"k": [1]})
    assert check_arguments(print, "print", (1,), {}) == ((1,), {})  # a builtin: bound when called


ENV_FILE = '''
from rlkit.envs import Tools


def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


class Loud(Tools):
    tools = [shout]

    def __init__(self, bonus: float = 0.0, sandbox=None):
        super().__init__(sandbox=sandbox)
        self.bonus = bonus

    def score(self, answer, example):
        return float(answer == example.answer) + self.bonus
'''


def test_tools_give_the_chat_template_their_json_schemas():
    """As a TRL class's: `tool_schemas()` on an instance (the driver renders message observations with it) and on
    the spec without one (chat-formatted --prompts): transformers' get_json_schema where the docstring documents
    every argument (calc's mul), else the description's first line and the types from the hints, named as the tool
    is named."""
    from transformers.utils import get_json_schema

    spec = get_env("calc")
    assert spec.tool_schemas() == [get_json_schema(mul)] and list(spec.make().tool_schemas()) == spec.tool_schemas()
    assert spec.tool_schemas()[0]["function"]["parameters"]["properties"]["a"] == {
        "type": "integer", "description": "the first factor"}

    def add(a: int, b: float | None = 1.0, *rest, c: str = "", d=None) -> float:
        """Add b to a.

        No Args section: transformers cannot describe it."""
        return a + (b or 0)

    (schema,) = Tools(functions={"plus": add}).tool_schemas()
    assert schema == {"type": "function", "function": {
        "name": "plus", "description": "Add b to a.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": ["number", "null"]},
                                                        "c": {"type": "string"}, "d": {}},
                       "required": ["a"]}}}
    assert get_env("guess").tool_schemas() is None  # no tools: no schemas


def test_a_subclass_in_a_file_through_env_spec(tmp_path):
    (tmp_path / "loud.py").write_text(ENV_FILE)
    spec = get_env(f"{tmp_path / 'loud.py'}:Loud:bonus=0.5")
    assert spec.attribute("stop") == ("</call>", "</tool_call>")
    env = spec.make()
    env.reset(Example("p", "say hi", "HI", "train"))
    assert _obs(env.step("<call>shout('hi')</call>")) == "HI"
    assert env.step("HI") == Step(None, 1.5, terminated=True)


# -- calc ---------------------------------------------------------------------------------------------------------

def test_calc_task_and_env_share_their_problems_and_split():
    task = get_task("calc")
    assert task == Calc() and get_task(task.spec) == task and task.spec == "calc:digits=2,heldout=0.1"
    env = get_env("calc").make()
    train = task.examples("train", 300, seed=4)
    assert list(itertools.islice(env.iter_examples("train", 4), 300)) == train
    held = task.examples("heldout", 200, seed=4)
    assert list(itertools.islice(env.iter_examples("heldout", 4), 200)) == held
    assert len({e.prompt for e in held}) == 200
    assert all(is_heldout(e.prompt, 0.1) for e in held) and not any(is_heldout(e.prompt, 0.1) for e in train)
    for e in train[:50]:
        a, b = map(int, re.fullmatch(r"<(\d\d)\*(\d\d)>=", e.prompt).groups())
        assert 10 <= a <= 99 and 10 <= b <= 99 and e.answer == str(a * b)
    # tool=F changes only the SFT targets; digits changes the problems
    assert get_task("calc:tool=0.5").examples("train", 20, 4) == train[:20]
    three = get_task("calc:digits=3").examples("train", 20, 4)
    assert all(re.fullmatch(r"<\d{3}\*\d{3}>=", e.prompt) for e in three)
    assert list(itertools.islice(get_env("calc:digits=3").make().iter_examples("train", 4), 20)) == three


def test_calc_sft_targets_are_the_rollouts_transcript():
    task = get_task("calc")
    ex = Example("x", "<37*48>=", "1776", "train")
    assert task.completion(ex) == "<call>mul(37,48)</call><tool>1776</tool>1776"
    assert task.reward("<call>mul(37,48)</call><tool>1776</tool>1776", "1776") == 1.0
    assert task.reward("<call>mul(37,48)</call><tool>1776</tool>1770", "1776") == 0.0
    # tool=0.4: about 60% of the prompts (fixed per prompt) answer without the tool
    some = get_task("calc:tool=0.4")
    exs = some.examples("train", 400, 0)
    bare = [some.completion(e) == f"The product is {e.answer}." for e in exs]
    assert 0.5 < sum(bare) / len(bare) < 0.7 and [some.completion(e) == f"The product is {e.answer}." for e in exs] == bare
    assert all(some.completion(e) == task.completion(e) for e, b in zip(exs, bare, strict=True) if not b)
    assert all(get_task("calc:tool=0").completion(e) == f"The product is {e.answer}." for e in exs[:20])
    assert task.max_new_tokens >= len(task.completion(Example("x", "<99*99>=", "9801", "train")))


@pytest.mark.parametrize(("spec", "error"), [
    ("calc:digits=0", "calc: digits=0: expected 1 <= digits <= 6"),
    ("calc:heldout=1", "calc: heldout=1: expected 0 < heldout < 1"),
    ("calc:tool=2", "calc: tool=2: expected 0 <= tool <= 1"),
    ("calc:digits=two", "--task calc: digits='two' is not a number"),
    ("calc:ops=2", "unknown option 'ops' for task calc; expected digits=N, heldout=F, tool=F"),
])
def test_calc_task_options_are_checked(spec, error):
    with pytest.raises(RlkitError, match=re.escape(error)):
        get_task(spec)


def test_calc_env_episode():
    env = get_env("calc:digits=2").make()
    assert isinstance(env, CalcEnv) and CalcEnv.max_new_tokens >= len("<call>mul(9999,9999)</call>")
    ex = Example("x", "<37*48>=", "1776", "heldout")
    assert env.reset(ex) == "<37*48>="
    assert _obs(env.step("<call>mul(37,48)</call>")) == "1776"
    assert env.step("1776") == Step(None, 1.0, terminated=True) and env.tool_calls == 1
    env.reset(ex)
    assert env.step("The answer is 1776.") == Step(None, 1.0, terminated=True) and env.tool_calls == 0
    env.reset(ex)
    assert env.step("1767") == Step(None, 0.0, terminated=True)
    with pytest.raises(RlkitError, match="calc: digits=7: expected 1 <= digits <= 6"):
        get_env("calc:digits=7").make()


# -- the sandbox ----------------------------------------------------------------------------------------------------

SANDBOXED = '''
import os
import time

from rlkit.envs import Tools


def seen(path: str) -> bool:
    return os.path.exists(path)


def sleepy(seconds: float) -> str:
    time.sleep(seconds)
    return "awake"


def oops(x: int) -> int:
    raise ValueError(f"bad {x}")


def pair(x: list) -> str:
    return repr(x)


class Box(Tools):
    tools = [seen, sleepy, oops, pair]
    timeout = 1.0
'''


def _sandboxed_env(tmp_path: Path, kind: str):
    d = tmp_path / "tools"
    d.mkdir()
    (d / "box.py").write_text(SANDBOXED)
    secret = tmp_path / "secret.txt"
    secret.write_text("host only")
    return get_env(f"{d / 'box.py'}:Box:sandbox={kind}"), secret


def _run_sandboxed(spec, secret: Path):
    a, b = spec.make(), spec.make()  # two trajectories share one worker
    for env in (a, b):
        env.reset(EX)
    assert _obs(a.step(f"<call>seen({str(secret)!r})</call>")) in ("False", "True")
    (pool,) = a._pools
    assert b._pools == [pool] and pool.users == 2
    assert _obs(b.step("<call>oops(3)</call>")) == "error: oops raised ValueError: bad 3"
    assert _obs(a.step("<call>pair((1, 2))</call>")) == "[1, 2]"  # arguments travel as JSON
    assert _obs(a.step("<call>pair({1})</call>")) == \
        "error: pair: an argument of type set cannot be sent to the sandbox (arguments travel as JSON)"
    assert _obs(b.step("<call>sleepy(30)</call>")) == "error: sleepy did not return within 1 s"
    assert _obs(b.step("<call>sleepy(0)</call>")) == "awake"  # a fresh worker after the overrun
    assert _obs(a.step("<call>oops('x')</call>")) == "error: oops: argument x must be an int, got 'x' (str)"
    (workers,) = pool.idle  # calls one after another: one worker, taken and given back by each
    procs = [w.proc for w in workers.live]
    seen = _obs(a.step(f"<call>seen({str(secret)!r})</call>"))
    a.close()
    assert pool.idle == [workers] and workers.live  # b still uses it
    b.close()
    assert not pool.idle and not workers.live and all(p.poll() is not None for p in procs) and not tools_mod._POOLS
    return seen


@needs_bwrap
def test_tools_run_in_bwrap(tmp_path):
    spec, secret = _sandboxed_env(tmp_path, "bwrap")
    assert _run_sandboxed(spec, secret) == "False"  # the host's file is not there in the sandbox
    plain = spec.factory()
    plain.reset(EX)
    assert _obs(plain.step(f"<call>seen({str(secret)!r})</call>")) == "True"  # in the stage's process it is

    from rlkit.sandbox import Sandbox

    calc = CalcEnv(sandbox=Sandbox("bwrap", workers=1))  # a built-in's tools: a module's function by name
    calc.reset(Example("x", "<37*48>=", "1776", "train"))
    assert _obs(calc.step("<call>mul(37,48)</call>")) == "1776"
    calc.close()


def test_tools_in_unisolated_workers(tmp_path):
    spec, secret = _sandboxed_env(tmp_path, "none")
    assert _run_sandboxed(spec, secret) == "True"  # no isolation: a plain process of the same user


def test_tools_the_sandbox_cannot_import_are_refused():
    def local(x: int) -> int:
        return x

    with pytest.raises(RlkitError, match="tool 'local' cannot run in the sandbox: it is not a module-level function"):
        Tools(functions=[local], sandbox="none")
    with pytest.raises(RlkitError, match="sandbox='docker': expected one of bwrap, none"):
        Tools(functions=[mul], sandbox="docker")
    assert not tools_mod._POOLS


# -- the driver on the real tiny model -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def calc_policy(tmp_path_factory) -> Path:
    """The tiny model after a short SFT on calc transcripts: it calls the tool (its operands often wrong)."""
    out = tmp_path_factory.mktemp("calc") / "sft"
    r = subprocess.run([sys.executable, "-m", "rlkit", "sft", "--task", "calc", "--out", str(out), "--num-examples",
                        "600", "--eval-num", "4", "--batch-tokens", "512", "-q"], capture_output=True, timeout=600)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return out


@pytest.mark.slow
def test_driver_runs_calc_on_the_tiny_model_token_exact(calc_policy):
    from rlkit import engines
    from rlkit.engines import EngineOptions
    from rlkit.sampling.driver import Prompts, Sampling, run_episodes

    eng = engines.create("hf", calc_policy, EngineOptions(device="cpu"))
    tok = eng.tokenizer
    env = get_env("calc")
    ex = list(itertools.islice(env.make().iter_examples("heldout", 0), 6))
    prompt_ids = [tok(e.prompt)["input_ids"] for e in ex]
    prompts = Prompts(0, [e.prompt_id for e in ex], [e.answer for e in ex], [e.prompt for e in ex], prompt_ids)
    s = Sampling(n=1, temperature=0, max_new_tokens=CalcEnv.max_new_tokens, max_turns=3)
    cols = run_episodes(eng, tok, env, prompts, s, seed=1).columns

    # the same turns again, by hand: greedy turns of the active trajectories, each call's result appended as the
    # tokens of <tool>RESULT</tool> (mask 0)
    want = [[] for _ in ex]
    mask = [[] for _ in ex]
    calls = [0] * len(ex)
    rewards = [0.0] * len(ex)
    active = list(range(len(ex)))
    for _turn in range(s.max_turns):
        if not active:
            break
        gen = eng.sample([prompt_ids[i] + want[i] for i in active], n=1, temperature=0, top_p=1.0,
                         max_new_tokens=CalcEnv.max_new_tokens, seed=0, stop=CalcEnv.stop)
        still = []
        for i, ids in zip(active, gen.completion_ids, strict=True):
            want[i] += ids
            mask[i] += [1] * len(ids)
            text = tok.decode(ids, skip_special_tokens=True)
            call = parse_call(text)
            if call is None:
                rewards[i] = last_integer(text, ex[i].answer)
                continue
            calls[i] += 1
            env1 = CalcEnv()
            env1.reset(ex[i])
            step = env1.step(text)
            obs = tok(f"<tool>{step.observation[0]['content']}</tool>", add_special_tokens=False)["input_ids"]
            if _turn + 1 < s.max_turns:
                want[i] += obs
                mask[i] += [0] * len(obs)
                still.append(i)
        active = still
    assert cols["completion_ids"] == want and cols["loss_mask"] == mask
    assert cols["tool_calls"] == calls and cols["reward/env"] == rewards
    assert all(len(lp) == len(m) for lp, m in zip(cols["old_logprobs"], cols["loss_mask"], strict=True))
    assert all(lp == 0.0 for lps, m in zip(cols["old_logprobs"], mask, strict=True)
               for lp, k in zip(lps, m, strict=True) if k == 0)
    assert sum(calls) >= 3, [tok.decode(c) for c in want]  # the SFT'd model does call the tool
    for c, n in zip(cols["completion_ids"], calls, strict=True):
        if n == 1:  # the transcript's shape, as sft trained it (the call, its result or error, the answer)
            assert re.fullmatch(r"<call>mul\([^<]*\)</call><tool>[^<]+</tool>[^<]*(<eos>)?", tok.decode(c)), tok.decode(c)


SESSION_TOOL = '''
from rlkit.envs.calc import CalcEnv
from rlkit.sandbox.interpreter import Interpreter


def mul(a: int, b: int) -> int:
    """Multiply two integers."""


class _Session:  # one trajectory's: a sandboxed interpreter that computes the product and counts the calls
    def __init__(self, sandbox):
        self.py = Interpreter(sandbox or "bwrap", timeout=5)

    def call(self, a, b):
        run = self.py.run(f"calls = globals().get('calls', 0) + 1\\nprint({a} * {b}, calls)")
        return run.ok, run.text()

    def kill(self):
        self.py.kill()

    def close(self):
        self.py.close()


class SandboxedMul:
    name = "mul"
    function = staticmethod(mul)

    def session(self, sandbox):
        return _Session(sandbox)


class PyCalc(CalcEnv):
    tools = [SandboxedMul()]
'''


@pytest.mark.slow
@pytest.mark.skipif(bwrap_path() is None and not os.environ.get("RLKIT_REQUIRE_SANDBOX"),
                    reason="bwrap (bubblewrap) not installed; RLKIT_REQUIRE_SANDBOX unset")
def test_driver_runs_a_session_tool_in_sandboxed_interpreters(calc_policy, tmp_path):
    """The calc model's calls answered by a session tool (as the built-in python tool is one): a sandboxed interpreter
    per trajectory, its state kept across the trajectory's calls, through the driver's threads; every interpreter
    gone when run_episodes returns."""
    from rlkit import engines
    from rlkit.engines import EngineOptions
    from rlkit.sampling.driver import Prompts, Sampling, run_episodes

    (tmp_path / "pycalc.py").write_text(SESSION_TOOL)
    eng = engines.create("hf", calc_policy, EngineOptions(device="cpu"))
    tok = eng.tokenizer
    env = get_env(f"{tmp_path / 'pycalc.py'}:PyCalc")
    ex = list(itertools.islice(get_env("calc").make().iter_examples("heldout", 0), 12))
    prompt_ids = [tok(e.prompt)["input_ids"] for e in ex]
    prompts = Prompts(0, [e.prompt_id for e in ex], [e.answer for e in ex], [e.prompt for e in ex], prompt_ids)
    s = Sampling(n=1, temperature=0, max_new_tokens=CalcEnv.max_new_tokens, max_turns=3)
    kids = _children()
    cols = run_episodes(eng, tok, env, prompts, s, seed=1).columns
    assert _children() <= kids  # no trajectory's interpreter outlives its trajectory
    seen = 0
    for ids, n in zip(cols["completion_ids"], cols["tool_calls"], strict=True):
        text = tok.decode(ids)
        found = re.findall(r"<call>mul\((-?\d+), ?(-?\d+)\)</call><tool>([^<]*)</tool>", text)
        assert len(found) <= n  # (a call in the last turn gets no result appended)
        for k, (a, b, result) in enumerate(found):
            assert result == f"{int(a) * int(b)} {k + 1}", text  # the product, and the trajectory's own call count
        seen += len(found)
    assert seen >= 1, "\n".join(tok.decode(c) for c in cols["completion_ids"])  # (its operands are often wrong)


def _children() -> set[int]:
    me, out = os.getpid(), set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(stat[1]) == me and stat[0] != "Z":
                out.add(int(d.name))
    return out


def test_the_stages_sandbox_reaches_an_environment_that_takes_one(tmp_path):
    """`rollout --sandbox bwrap --env SPEC` builds the environment with sandbox=bwrap when its constructor takes a
    `sandbox` keyword and the spec set none; a spec's own sandbox= wins; an environment without the keyword is
    left as it is."""
    from rlkit.envs import get_env

    assert get_env("calc").sandboxed("bwrap").options["sandbox"] == "bwrap"
    assert get_env("calc").sandboxed(None).options.get("sandbox") is None
    assert get_env("calc:sandbox=none").sandboxed("bwrap").options["sandbox"] == "none"
    f = tmp_path / "plain_env.py"
    f.write_text("class Plain:\n    def reset(self, ex):\n        return ex.prompt\n"
                 "    def step(self, a):\n        return None, 0.0, True\n")
    assert "sandbox" not in get_env(f"{f}:Plain").sandboxed("bwrap").options
