"""Multi-turn agents (docs/agents.md): tool-call parsing, the environment contract, token-in
token-out trajectories on the HF engine (the vLLM engine's are in tests/test_vllm_engine.py),
the loss mask and log-probs of a 2-turn episode by hand, and the sandbox's containment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fitrl.agents import Environment, Step
from fitrl.agents.builtin_tools import calculator, python
from fitrl.agents.env import (BUILTIN_ENVIRONMENTS, EnvironmentError_, check_agent_spec, checked_step,
                              load_environment)
from fitrl.agents.sandbox import SandboxLimits, ToolSandbox
from fitrl.memory import calibration as C
from fitrl.agents.tools import parse_tool_calls, reply_text, tool_schemas
from fitrl.config.agent import AgentConfig
from fitrl.config.schema import SamplingConfig
from fitrl.core.errors import ConfigError
from fitrl.data.batch import Batch
from fitrl.rollout.agent import AgentRollout, agent_metrics
from fitrl.rollout.engine import RolloutEngine
from fitrl.rollout.hf import HFRollout
from agent_helpers import NAP_TOOL, NapEngine, Talk3, check_three_turn_trajectories, spy_on_turns

# -- tool calls and tools (no model) ---------------------------------------------------------------


def test_tool_calls_parse_in_the_hermes_format_and_each_bad_call_says_why():
    text = ('I will compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"4\\"}"}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
            '<tool_call>{"name": calculator}</tool_call>'
            '<tool_call>["calculator"]</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'
            '<tool_call>{"name": "calculator"')
    calls = parse_tool_calls(text, ["calculator"])
    assert [(c.name, c.arguments) for c in calls[:2]] == [("calculator", {"expression": "2+3"}),
                                                          ("calculator", {"expression": "4"})]
    assert not calls[0].error and not calls[1].error
    errors = [c.error for c in calls[2:]]
    assert "names no tool: 'search' (tools: calculator)" in errors[0]
    assert "tool call 4 is not valid JSON" in errors[1]
    assert "must be a JSON object" in errors[2]
    assert '"arguments" must be an object' in errors[3]
    assert errors[4] == "tool call 7 has no closing </tool_call>"
    assert parse_tool_calls("The answer is 5.", ["calculator"]) == []


def test_builtin_tools_compute_and_refuse():
    assert calculator("37 * (12 + 5)") == "629"
    assert calculator("7 / 2") == "3.5"
    with pytest.raises(ValueError, match="too large"):
        calculator("9 ** 9 ** 9")
    with pytest.raises(ValueError, match="not arithmetic"):
        calculator("__import__('os')")
    assert python("x = 6\nprint(x * 7)\nx + 1") == "42\n7\n"
    assert reply_text("a" * 30, 10) == "a" * 10 + "... [20 more characters cut]"


def test_a_tool_without_a_documented_signature_is_one_config_line(tmp_path):
    f = tmp_path / "my_tools.py"
    f.write_text("def lookup(key):\n    return key\n")
    with pytest.raises(ConfigError, match=r"rollout.agent.tools: .*my_tools.py:lookup: no JSON schema .*Args:"):
        tool_schemas([f"{f}:lookup"])
    with pytest.raises(ConfigError, match="unknown name 'calculater'; did you mean 'calculator'"):
        check_agent_spec("tools", ["calculater"])
    with pytest.raises(ConfigError, match="file not found"):
        check_agent_spec(str(tmp_path / "nope.py") + ":Env", [])


def test_the_tiny_chat_template_renders_tools_as_qwen_and_nothing_else_changed(tiny_model_dir):
    """Without tools the text is what the template wrote before tools existed (the single-turn
    demo's prompts are byte for byte the same); with them, Qwen2.5's layout."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"
        "<|im_start|>assistant\n")
    tools = tool_schemas(["calculator"])
    text = tok.apply_chat_template(conv[:2] + [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "calculator", "arguments": {"expression": "1+2"}}}]},
        {"role": "tool", "content": "3"}, {"role": "tool", "content": "4"}], tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\nS\n\n# Tools\n")
    assert '"name": "calculator"' in text.split("\n</tools>")[0]
    assert text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
                         '"1+2"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n'
                         '<tool_response>\n4\n</tool_response><|im_end|>\n')


def test_environment_classes_and_steps_are_checked(tmp_path):
    f = tmp_path / "envs.py"
    f.write_text("class NotAnEnv:\n    pass\n")
    with pytest.raises(ConfigError, match="not a subclass of fitrl.agents.Environment"):
        load_environment(f"{f}:NotAnEnv")
    bad = tmp_path / "broken.py"
    bad.write_text("class Env(:\n")
    with pytest.raises(ConfigError, match="syntax error"):
        load_environment(f"{bad}:Env")
    with pytest.raises(EnvironmentError_, match="must return a fitrl.agents.Step, got dict"):
        checked_step({"done": True}, "E.step()")
    with pytest.raises(EnvironmentError_, match="reward=nan"):
        checked_step(Step(reward=float("nan"), done=True), "E.step()")
    with pytest.raises(EnvironmentError_, match="not done and has no messages"):
        checked_step(Step(), "E.step()")


# -- episodes on an engine -------------------------------------------------------------------------


class ScriptedEngine(RolloutEngine):
    """Returns, for each context, the next of its episode's scripted turns (ids, log-prob each)."""

    def __init__(self, turns: list[tuple[list[int], float]], eos: int, pad: int):
        self.turns, self.eos, self.pad, self.calls = turns, eos, pad, 0

    @classmethod
    def from_config(cls, *a, **k):
        raise NotImplementedError

    def generate(self, prompts: Batch, sampling: SamplingConfig) -> Batch:
        ids, lp = self.turns[self.calls]
        self.calls += 1
        rows = len(prompts)
        r = torch.tensor([ids] * rows)
        return Batch({"responses": r, "response_mask": torch.ones_like(r),
                      "finished": torch.tensor([int(self.eos in ids)] * rows),
                      "rollout_logprobs": torch.full(r.shape, lp)})


def _prompts(messages: list[list[dict]], tokenizer, tools=None) -> Batch:
    ids = [tokenizer.apply_chat_template(m, tools=tools, add_generation_prompt=True, tokenize=True) for m in messages]
    ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
    n = len(messages)
    return Batch(fields={"prompt_ids": ids, "prompt_messages": messages, "answer": ["5"] * n,
                         "source": [f"t.jsonl:{i + 1}" for i in range(n)], "extra": [{}] * n,
                         "uid": [f"u{i}" for i in range(n)]})


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_two_turn_episode_by_hand(tokenizer):
    """One tool call, its reply, an answer: the trajectory, loss mask, attention and log-probs."""
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    t1 = tokenizer(call, add_special_tokens=False)["input_ids"] + [eos]
    t2 = tokenizer("5", add_special_tokens=False)["input_ids"] + [eos]
    engine = ScriptedEngine([(t1, -0.5), (t2, -0.25)], eos, pad)
    agent = AgentRollout(engine, tokenizer, AgentConfig(env="tools", tools=["calculator"], tool_workers=1),
                         max_response_length=256, eos_ids=[eos], pad_id=pad)
    try:
        prompts = _prompts([[{"role": "user", "content": "What is 2+3?"}]], tokenizer, agent.schemas)
        out = agent.generate(prompts, SamplingConfig(n=1, max_tokens=256))
    finally:
        agent.close()
    env = tokenizer("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                    add_special_tokens=False)["input_ids"]
    expected = t1 + env + t2
    P = len(prompts["prompt_ids"][0])
    assert out["input_ids"][0, :P].tolist() == prompts["prompt_ids"][0]
    assert out["responses"][0].tolist() == expected
    assert out["response_mask"][0].tolist() == [1] * len(t1) + [0] * len(env) + [1] * len(t2)
    assert out["attention_mask"][0].tolist() == [1] * (P + len(expected))
    assert out["rollout_logprobs"][0].tolist() == [-0.5] * len(t1) + [0.0] * len(env) + [-0.25] * len(t2)
    assert out["finished"].tolist() == [1]
    assert out["response_text"] == ["5"]
    conv = out["conversation"][0]
    assert [m["role"] for m in conv] == ["user", "assistant", "tool", "assistant"]
    assert conv[1]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "2+3"}}
    assert conv[2]["content"] == "5"
    m = agent_metrics(out)
    assert (m["agent/turns"], m["agent/tool_calls"], m["agent/tool_errors"], m["agent/cut/turns"]) == (2, 1, 0, 0)


def _eos_biased(model, eos: int, bias: float):
    """The model ends its turns often (a random model almost never samples EOS otherwise)."""
    shift = torch.zeros(model.config.vocab_size)
    shift[eos] = bias
    return model.lm_head.register_forward_hook(lambda mod, inp, out: out + shift)


def test_hf_episodes_are_token_exact_and_their_logprobs_are_the_sampled_ones(tiny_model_dir, tokenizer, monkeypatch):
    """3-turn episodes on the HF decode loop: the trajectory is the sampled ids plus each
    environment reply tokenized once, although re-encoding the decoded turns gives other ids
    (a re-tokenizing rollout fails here), and a forward over the trajectory gives the recorded
    log-probs at every model token."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setitem(BUILTIN_ENVIRONMENTS, "talk3", Talk3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    hook = _eos_biased(model, eos, 6.0)
    engine = HFRollout(model, tokenizer, decode="loop")
    sampled = spy_on_turns(engine)
    agent = AgentRollout(engine, tokenizer, AgentConfig(env="talk3", max_turns=3, max_tokens_per_turn=16),
                         max_response_length=128, eos_ids=engine.eos_ids, pad_id=engine.pad_id)
    try:
        out = agent.generate(_prompts([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]],
                                      tokenizer), SamplingConfig(n=4, max_tokens=16))
        assert check_three_turn_trajectories(out, sampled, tokenizer, eos) > 0
        assert out["env_reward"] == [1.5] * len(out)
        with torch.no_grad():
            logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                           position_ids=out["position_ids"]).logits.float()
        R = out["responses"].shape[1]
        lp = torch.log_softmax(logits[:, -R - 1:-1], -1).gather(-1, out["responses"][..., None]).squeeze(-1)
        mask = out["response_mask"].bool()
        torch.testing.assert_close(lp[mask], out["rollout_logprobs"][mask], atol=2e-4, rtol=0)
    finally:
        agent.close()
        hook.remove()


def test_environment_errors_are_counted_and_a_broken_class_stops_the_batch(tokenizer, monkeypatch, caplog):
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id

    class Flaky(Environment):
        def step(self, turn):
            if self.row["source"].endswith(":1"):
                raise KeyError("boom")
            return Step(reward=1.0, done=True)

    class WrongType(Environment):
        def step(self, turn):
            return 1.0

    monkeypatch.setitem(BUILTIN_ENVIRONMENTS, "flaky", Flaky)
    monkeypatch.setitem(BUILTIN_ENVIRONMENTS, "wrong", WrongType)
    t = tokenizer("7", add_special_tokens=False)["input_ids"] + [eos]
    prompts = _prompts([[{"role": "user", "content": "q"}]] * 3, tokenizer)
    agent = AgentRollout(ScriptedEngine([(t, -1.0)], eos, pad), tokenizer, AgentConfig(env="flaky"),
                         max_response_length=32, eos_ids=[eos], pad_id=pad)
    out = agent.generate(prompts, SamplingConfig(n=1, max_tokens=32))
    assert [s["cut"] for s in out["agent_stats"]] == ["env_error", "", ""]
    assert out["env_reward"] == [0.0, 1.0, 1.0]
    assert "raised in step (turn 1) for row t.jsonl:1: KeyError" in caplog.text
    agent = AgentRollout(ScriptedEngine([(t, -1.0)], eos, pad), tokenizer, AgentConfig(env="flaky"),
                         max_response_length=32, eos_ids=[eos], pad_id=pad, max_error_fraction=0.2)
    with pytest.raises(EnvironmentError_, match="raised on 1 of 3 episodes"):
        agent.generate(prompts, SamplingConfig(n=1, max_tokens=32))
    agent = AgentRollout(ScriptedEngine([(t, -1.0)], eos, pad), tokenizer, AgentConfig(env="wrong"),
                         max_response_length=32, eos_ids=[eos], pad_id=pad)
    with pytest.raises(EnvironmentError_, match=r"wrong.step\(\) \(row t.jsonl:1, turn 1\) must return a fitrl.agents.Step"):
        agent.generate(prompts, SamplingConfig(n=1, max_tokens=32))


def test_the_limits_cut_episodes_and_say_which(tokenizer):
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    call = tokenizer('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>',
                     add_special_tokens=False)["input_ids"] + [eos]
    prompts = _prompts([[{"role": "user", "content": "q"}]], tokenizer)
    for cfg, budget, cut, turns in ((dict(max_turns=2), 512, "turns", 2),   # calls tools forever
                                    (dict(max_turns=9), 80, "total_tokens", 1)):  # no room for the reply and a turn
        agent = AgentRollout(ScriptedEngine([(call, -1.0)] * 9, eos, pad), tokenizer,
                             AgentConfig(env="tools", tools=["calculator"], tool_workers=1, **cfg),
                             max_response_length=budget, eos_ids=[eos], pad_id=pad)
        try:
            out = agent.generate(prompts, SamplingConfig(n=1, max_tokens=budget))
        finally:
            agent.close()
        assert (out["agent_stats"][0]["cut"], out["agent_stats"][0]["turns"]) == (cut, turns)
        assert out["finished"].tolist() == [0]
        assert int(out["attention_mask"][0].sum()) - len(out["prompt_ids"][0]) <= budget


def test_a_slow_tool_holds_up_only_its_own_episode(tokenizer, tmp_path):
    """With ``overlap`` (the default) the fast episode takes its next two turns while the slow one's
    tool still runs; without it, turns go in rounds. The trajectories are the same either way."""
    (tmp_path / "naps.py").write_text(NAP_TOOL)
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    cfg = dict(env="tools", tools=[f"{tmp_path}/naps.py:nap"], tool_workers=2, max_turns=4)
    prompts = _prompts([[{"role": "user", "content": "slow"}], [{"role": "user", "content": "fast"}]], tokenizer,
                       tools=tool_schemas(cfg["tools"]))
    outs = {}
    for overlap, batches in ((True, [["slow", "fast"], ["fast"], ["fast"], ["slow"]]),
                             (False, [["slow", "fast"], ["slow", "fast"], ["fast"]])):
        engine = NapEngine(tokenizer, eos)
        agent = AgentRollout(engine, tokenizer, AgentConfig(**cfg, overlap=overlap), max_response_length=256,
                             eos_ids=[eos], pad_id=pad)
        try:
            outs[overlap] = agent.generate(prompts, SamplingConfig(n=1, max_tokens=64))
        finally:
            agent.close()
        assert engine.batches == batches, overlap
        assert [s["turns"] for s in outs[overlap]["agent_stats"]] == [2, 3]
        assert [s["tool_calls"] for s in outs[overlap]["agent_stats"]] == [1, 2]
        assert outs[overlap]["response_text"] == ["5", "5"]
    for key in ("responses", "response_mask", "attention_mask"):
        assert torch.equal(outs[True][key], outs[False][key]), key


# -- the sandbox -----------------------------------------------------------------------------------


def test_the_sandbox_contains_every_escape_and_goes_on(tmp_path):
    """Each call is contained within its limit and counted by its outcome; the pool answers the
    next call; nothing outside the scratch directory is touched."""
    outside = tmp_path / "outside.txt"
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    calls = {
        "loop": "while True:\n    pass",
        "alloc": "b = bytearray(30 * 2**30)",
        "fork": "import os\nwhile True:\n    os.fork()",
        "subprocess": "import subprocess\nsubprocess.run(['touch', %r])" % str(outside),
        "read": "print(open(%r).read())" % str(secret),
        "write": "open(%r, 'w').write('x')" % str(outside),
        "remove": "import os\nos.remove(%r)" % str(secret),
        "socket": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
        "segfault": "import faulthandler\nfaulthandler._sigsegv()",
        "scratch": "open('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read())",
    }
    sandbox = ToolSandbox(["python"], num_workers=2, timeout=2.0, limits=SandboxLimits(memory_bytes=1 << 30))
    try:
        outcomes = dict(zip(calls, sandbox.call([("python", {"code": c}) for c in calls.values()])))
        after = sandbox.call([("python", {"code": "print(6 * 7)"})])[0]
        rss = [_rss(w.proc.pid) for w in sandbox._workers]
    finally:
        sandbox.close()
    assert max(rss) <= 2 * C.TOOL_WORKER_HOST, rss  # the plan's figure for an idle worker holds
    assert outcomes["loop"].status == "timeout"
    assert outcomes["alloc"].status == "error" and outcomes["alloc"].detail.startswith("MemoryError")
    assert outcomes["segfault"].status == "error" and "died (exit code -11)" in outcomes["segfault"].detail
    for name in ("fork", "subprocess", "read", "write", "remove", "socket"):
        assert outcomes[name].status == "error", (name, outcomes[name])
        assert outcomes[name].detail.startswith("PermissionError: sandbox:"), (name, outcomes[name].detail)
    assert outcomes["scratch"].status == "ok" and outcomes["scratch"].value[0] == "ok\n"
    assert after.status == "ok" and after.value[0] == "42\n"
    assert sandbox.restarts == 2  # the hung worker and the crashed one, replaced
    assert not outside.exists() and secret.read_text() == "s3cret"
    assert not os.path.exists(sandbox.scratch_root)  # removed at close
    assert "audit hook" in sandbox.layers and "rlimits" in sandbox.layers


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def test_the_plan_counts_the_tool_workers_and_what_their_calls_may_allocate(tiny_model_dir):
    from fitrl.config import load_config
    from fitrl.planner.plan import Hardware, plan_config

    arith = Path(__file__).resolve().parents[1] / "examples" / "arith.yaml"
    cfg = load_config(arith, [f"actor.model.path={tiny_model_dir}", "trainer.device=cpu", "rollout.agent.env=tools",
                              "rollout.agent.tools=[calculator]", "rollout.agent.tool_workers=3",
                              "rollout.agent.tool_memory=1GiB", "data.max_prompt_length=1024"])
    plan = plan_config(cfg, Hardware.cpu(ranks_per_node=1, host_memory=64 * C.GIB))
    assert plan.node_host("update")["tool workers"] == 3 * C.TOOL_WORKER_HOST
    assert "tool calls (bound)" not in plan.node_host("update")
    assert plan.node_host("rollout")["tool calls (bound)"] == 3 * (C.GIB - C.TOOL_WORKER_HOST)


def test_the_report_shows_an_episode_turn_by_turn():
    from fitrl.report.page import sample_row

    row = sample_row({"step": 3, "split": "train", "prompt": "<|im_start|>user\nWhat is 2+3?", "response": "5",
                      "answer": 5, "reward": 1.0, "reward_components": {"exact": 1.0},
                      "conversation": [{"role": "user", "content": "What is 2+3?"},
                                       {"role": "assistant", "content": "<tool_call>{...}</tool_call>",
                                        "tool_calls": [{"type": "function", "function": {"name": "calculator"}}]},
                                       {"role": "tool", "name": "calculator", "content": "5"},
                                       {"role": "assistant", "content": "5"}],
                      "agent": {"turns": 2.0, "tool_calls": 1.0, "tool_errors": 0.0, "tool_timeouts": 0.0, "cut": ""}})
    assert row["response"] == "[assistant] <tool_call>{...}</tool_call>\n[tool calculator] 5\n[assistant] 5"
    assert row["components"] == "exact: 1\nepisode: 2 turns, 1 tool calls, 0 errors, 0 timeouts"


def test_validation_reports_the_episodes_too():
    from fitrl.roles.reward import Scored
    from fitrl.trainer.validation import ValidationSplits

    splits = ValidationSplits(n=1, source_key="src", extract=lambda text: text)
    stats = [{"turns": 2.0, "tool_calls": 1.0, "tool_seconds": 0.5, "tool_errors": 0.0, "tool_timeouts": 1.0,
              "tool_crashes": 0.0, "cut": ""},
             {"turns": 3.0, "tool_calls": 3.0, "tool_seconds": 0.1, "tool_errors": 2.0, "tool_timeouts": 0.0,
              "tool_crashes": 0.0, "cut": "turns"}]
    out = Batch({"response_mask": torch.ones(2, 3)},
                fields={"uid": ["a", "b"], "extra": [{}, {}], "response_text": ["5", "<tool_call>"],
                        "agent_stats": stats, "env_reward": [1.0, 0.0]})
    splits.add(out, Scored(torch.tensor([1.0, 0.0]), {"exact": torch.tensor([1.0, 0.0])}))
    m = splits.metrics()
    assert (m["val/agent/turns"], m["val/agent/tool_calls"], m["val/agent/tool_errors"]) == (2.5, 2.0, 2.0)
    assert (m["val/agent/tool_timeouts"], m["val/agent/cut/turns"], m["val/agent/env_reward"]) == (1.0, 0.5, 0.5)


def test_a_machine_without_namespaces_is_warned_about_once(tokenizer, caplog):
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    agent = AgentRollout(ScriptedEngine([], eos, pad), tokenizer,
                         AgentConfig(env="tools", tools=["calculator"], tool_workers=1),
                         max_response_length=32, eos_ids=[eos], pad_id=pad)
    try:
        agent.sandbox.layers = ["rlimits", "audit hook"]
        agent._log_layers()
        agent._log_layers()
    finally:
        agent.close()
    warned = [r.message for r in caplog.records if "tool sandbox" in r.message]
    assert warned == ["tool sandbox: this machine refused the pid namespace, filesystem view, network namespace (no "
                      "user namespaces); tools are bounded by rlimits, audit hook only, and a program one starts can "
                      "read and write what this user can"]


@pytest.mark.slow
def test_the_agent_demo_warm_starts_then_trains_episodes_with_the_calculator(tmp_path):
    """``fitrl demo --tools`` (examples/mul_tools.yaml), shortened: it makes the agent-size model,
    warm-starts it on the demonstration conversations, exports it, and trains GRPO on multi-turn
    episodes that call the calculator (the learning figures are docs/demo.md's, from full runs)."""
    import json
    import subprocess
    import sys

    import yaml

    from helpers import ROOT

    model, run = tmp_path / "model", tmp_path / "grpo"
    proc = subprocess.run([sys.executable, "-m", "fitrl.cli", "demo", "--tools", "--warm-start-steps", "3",
                           f"actor.model.path={model}", f"trainer.run_dir={run}", "trainer.max_steps=2",
                           "data.rollout_batch_size=4", "actor.mini_batch_size=4", "trainer.val_freq=0", "trainer.val_before_train=false", "rollout.val.n=1",
                           "trainer.progress_bar=false"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads((model / "fitrl_tiny.json").read_text())["size"] == "agent"
    assert "warm start: 3 supervised steps" in proc.stdout and "only 2 steps" in proc.stdout
    hf = Path(f"{run}-sft") / "hf"
    assert yaml.safe_load((run / "config.yaml").read_text())["actor"]["model"]["path"] == str(hf)
    steps = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "agent/turns" in r]
    assert len(steps) == 2 and all(r["agent/turns"] >= 1 for r in steps)
    episode = json.loads((run / "generations.jsonl").read_text().splitlines()[0])
    assert [m["role"] for m in episode["conversation"]][0] == "user" and "agent" in episode
