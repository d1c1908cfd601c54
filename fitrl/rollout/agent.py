"""Multi-turn episodes on any rollout engine, token in and token out (docs/agents.md).

An episode's trajectory is the exact token sequence of the episode: the prompt (the
environment's first messages through the chat template, with the tools, tokenized once), then
each model turn's sampled ids as the engine returned them (through its end-of-turn token), then
each environment reply rendered as the chat template renders it between assistant turns and
tokenized once. Decoded text is used for parsing tool calls, for the environment and for
rewards, and never encoded back into the trajectory: re-encoding a model's text can give other
ids than it sampled (BPE merges differ), and the trainer would then compute the log-probs of
tokens nobody sampled.

Model turns are batched: every episode ready for its next turn in one ``engine.generate`` call
(n=1 per context; a GRPO group's first prompt is shared, so the HF loop prefills it once). Their
tool calls go to the sandbox's workers, and with ``rollout.agent.overlap`` (the default) an
episode whose calls are back takes its environment step and joins the next generation while other
episodes' tools still run: a slow tool holds up only its own episode. Without it, turns run in
rounds (every live episode's turn, then every tool call of the round, then each ``step``), and the
batches sampled do not depend on the tools' timing.

The batch returned has the rollout layout of fitrl/rollout/engine.py, with R covering the whole
episode after the prompt (``rollout.max_response_length`` at most) and two differences:
``response_mask`` is the loss mask (the model's tokens only) while ``attention_mask`` covers every
real token, and ``finished`` is 1 where the environment ended the episode (0: a limit cut it).
Fields added per sequence: ``response_text`` (the last model turn's text, what reward functions
score), ``conversation`` (the messages, for generations.jsonl), ``env_reward`` and the episode's
counters (``agent_stats``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from fitrl.agents.env import (Environment, EnvironmentError_, ToolResult, Turn, checked_messages, checked_step,
                              load_environment)
from fitrl.agents.sandbox import (SandboxLimits, ToolSandbox, missing_layers, needs_confinement, probe_layers,
                                  refusal)
from fitrl.agents.tools import (ToolCall, added_strings, cut_to_tokens, parse_tool_calls, plain_ids, printable,
                                rendered_tools_missing, tool_schemas)
from fitrl.config.agent import AgentConfig
from fitrl.config.schema import FitrlConfig, SamplingConfig
from fitrl.core.errors import ConfigError
from fitrl.core.padding import left_pad, right_pad
from fitrl.data.batch import Batch
from fitrl.models.families.base import TEXT_INPUTS, ModelInputs
from fitrl.rollout.engine import RolloutEngine
from fitrl.rollout.layout import rollout_batch
from fitrl.telemetry.progress import PROGRESS

log = logging.getLogger("fitrl.agents")

CUT_REASONS = ("turns", "turn_tokens", "total_tokens", "env_error")
"""Why an episode ended before its environment said done (``agent/cut/<reason>``)."""
STATS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "tool_crashes", "tool_seconds")


@dataclass
class Episode:
    row: dict
    env: Optional[Environment]
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    """Everything after the prompt: model turns (as sampled) and environment replies (tokenized once)."""
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    env_reward: float = 0.0
    last_text: str = ""
    done: bool = False
    cut: str = ""
    stats: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STATS, 0.0))
    pending_calls: list[ToolCall] = field(default_factory=list)
    """The calls of the model's last turn, until its environment step."""
    results: list[Optional[ToolResult]] = field(default_factory=list)
    """Their results, as they come back from the sandbox."""
    outstanding: int = 0
    """Calls of the last turn still running in the sandbox."""

    @property
    def live(self) -> bool:
        return not self.done and not self.cut

    def context(self) -> list[int]:
        return self.prompt_ids + self.ids

    def add(self, ids: list[int], model: bool, logprobs: Optional[list[float]] = None) -> None:
        self.ids += ids
        self.loss_mask += [int(model)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


class EnvTurnEncoder:
    """An environment reply's token ids, as the chat template renders it after an assistant
    turn: rendered after a fixed stand-in conversation (so the history is never re-rendered,
    and a template that rewrites earlier turns, e.g. dropping their reasoning, changes nothing)
    and tokenized once. The text between the end-of-turn token and the next role (``\\n`` in
    ChatML) is the reply's, since the model's turn ends at its end-of-turn token. A message's
    content is text: a control token's string in it (a tool printing ``<|im_end|>``) is
    tokenized as plain text, never as the token (:func:`~fitrl.agents.tools.plain_ids`)."""

    ANSWER = "fitrl-stand-in-answer"
    BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": ANSWER}]

    def __init__(self, tokenizer, tools: list[dict], eos_ids: list[int]):
        self.tokenizer, self.tools = tokenizer, tools or None
        self.added = added_strings(tokenizer)
        self.base = self._render(self.BASE, generation_prompt=False)
        # the end-of-turn token the template writes right after the answer, and what follows it
        rest = self.base[self.base.rfind(self.ANSWER) + len(self.ANSWER):]
        ends = [tokenizer.decode([e]) for e in eos_ids]
        written = [e for e in ends if e and rest.startswith(e)]
        if not written:
            raise ConfigError(f"the chat template does not end an assistant turn with an end-of-turn token "
                              f"({', '.join(map(repr, ends[:4]))}): a model turn's end could not be joined to the "
                              "environment's reply; use a chat model's tokenizer")
        self.after_end = rest[len(max(written, key=len)):]

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def text(self, messages: list[dict]) -> str:
        full = self._render(self.BASE + messages, generation_prompt=True)
        if not full.startswith(self.base):
            raise ConfigError("the chat template renders earlier turns differently once an environment reply "
                              "follows them: the reply's tokens cannot be appended to the trajectory")
        return self.after_end + full[len(self.base):]

    def encode(self, messages: list[dict]) -> list[int]:
        contents = [m.get("content") if isinstance(m.get("content"), str) else "" for m in messages]
        if not any(s in c for c in contents for s in self.added):   # the usual case: one tokenization
            return self.tokenizer(self.text(messages), add_special_tokens=False)["input_ids"]
        # The template's text and each content tokenized apart, contents as plain text. Marks in
        # the Private Use Area stand for the contents: no template changes them.
        text = self.text([dict(m, content=f"\ue000{k}\ue001") for k, m in enumerate(messages)])
        ids: list[int] = []
        for k, piece in enumerate(re.split("\ue000(\\d+)\ue001", text)):
            if k % 2:
                ids += plain_ids(self.tokenizer, contents[int(piece)], self.added)
            elif piece:
                ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        return ids


def check_agent(cfg: FitrlConfig, tokenizer) -> None:
    """What the agent section needs, checked before any model loads: the environment imports
    and is an Environment, every tool has a schema, the chat template renders tools and joins
    replies to turns, and the engine's layout allows per-rank episodes."""
    a = cfg.rollout.agent
    if not a.enabled:
        return
    if not cfg.data.apply_chat_template:
        raise ConfigError("rollout.agent needs data.apply_chat_template=true: an episode's turns and tools are "
                          "rendered by the chat template")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"rollout.agent: the tokenizer of {cfg.actor.model.path} has no chat template")
    load_environment(a.env)
    schemas = tool_schemas(a.tools)
    missing = rendered_tools_missing(tokenizer, schemas)
    if missing is not None:
        raise ConfigError(f"rollout.agent.tools: the chat template of {cfg.actor.model.tokenizer_path or cfg.actor.model.path} "
                          f"does not render tools (tool {missing!r} is missing from apply_chat_template(tools=...)): "
                          "the model would be asked to call tools it is never shown; use a tokenizer whose chat "
                          "template supports tools (Qwen2.5, Qwen3, Llama 3.1+)")
    EnvTurnEncoder(tokenizer, schemas, [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    risky = needs_confinement(a.tools)
    if risky and not a.allow_unconfined_tools:  # the workers refuse too; this says so before any model loads
        missing = missing_layers(probe_layers(_limits(a)), a.tool_network)
        if missing:
            raise ConfigError(refusal(missing, risky))
    if cfg.rollout.tensor_parallel_size > 1 and cfg.world_size > 1 and cfg.rollout.capabilities.tensor_parallel:
        raise ConfigError("rollout.agent with rollout.tensor_parallel_size > 1 over several policy ranks is not "
                          "supported: the ranks of one engine would run different episodes")


class AgentRollout:
    """Runs episodes on ``engine``; ``close()`` stops the sandbox."""

    def __init__(self, engine: RolloutEngine, tokenizer, cfg: AgentConfig, *, max_response_length: int,
                 eos_ids: list[int], pad_id: int, inputs: ModelInputs = TEXT_INPUTS, max_error_fraction: float = 0.5,
                 max_prompt_length: int = 1 << 30):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.max_prompt_length = max_prompt_length
        self.max_response_length, self.eos_ids, self.pad_id, self.inputs = max_response_length, eos_ids, pad_id, inputs
        self.max_error_fraction = max_error_fraction
        self.env_cls = load_environment(cfg.env)
        self.schemas = tool_schemas(cfg.tools)
        self.tool_names = [s["function"]["name"] for s in self.schemas]
        self.encoder = EnvTurnEncoder(tokenizer, self.schemas, eos_ids)
        self.sandbox = (ToolSandbox(cfg.tools, num_workers=cfg.tool_workers, timeout=cfg.tool_timeout,
                                    limits=_limits(cfg)) if cfg.tools else None)
        self._calls: dict[int, tuple[Episode, int]] = {}   # a sandbox call's key -> its episode and index
        self._logged_layers = False
        self._logged_env_error = False

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    # -- one batch of episodes ---------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: Batch, sampling: SamplingConfig) -> Batch:
        seqs = prompts.repeat_interleave(sampling.n)
        episodes = [self._start(self._row(seqs, i)) for i in range(len(seqs))]
        self._calls = {}
        per_turn = min(self.cfg.max_tokens_per_turn or self.max_response_length, self.max_response_length)
        order = {id(e): i for i, e in enumerate(episodes)}
        ready = [e for e in episodes if e.live]   # to take a model turn, in the batch's order
        calling: list[Episode] = []               # between a model turn and its environment step
        while ready or calling:
            if ready:
                self._model_turn(ready, sampling, per_turn)
                for e in ready:
                    if e.live:
                        self._submit_tools(e)
                        calling.append(e)
                ready = []
            if self.cfg.overlap:  # wait only when no episode could go on
                self._collect_tools(block=all(e.outstanding for e in calling))
            else:
                while any(e.outstanding for e in calling):
                    self._collect_tools(block=True)
            stepped = [e for e in calling if not e.outstanding]
            calling = [e for e in calling if e.outstanding]
            for e in stepped:
                self._environment_turn(e)
                if e.live and e.stats["turns"] >= self.cfg.max_turns:  # still calling tools after max_turns
                    e.cut = "turns"
                if e.live:
                    ready.append(e)
            ready.sort(key=lambda e: order[id(e)])
        self._check_errors(episodes)
        return self._batch(prompts, seqs, episodes)

    @staticmethod
    def _row(seqs: Batch, i: int) -> dict:
        return {k: seqs[k][i] for k in ("prompt_ids", "prompt_messages", "answer", "source", "extra") if k in seqs.fields}

    def _start(self, row: dict) -> Episode:
        e = Episode(row=row, env=None)
        try:
            e.env = self.env_cls(row, **self.cfg.env_kwargs)
            e.messages = checked_messages(e.env.reset(), f"{self.cfg.env}.reset() (row {row.get('source')})")
        except EnvironmentError_:
            raise
        except Exception as err:  # noqa: BLE001 -- the user's environment: counted like a reward error
            self._env_failed(e, "reset", err)
            e.messages = [dict(m) for m in row["prompt_messages"]]
        if e.messages == row["prompt_messages"] and "prompt_ids" in row:
            e.prompt_ids = list(row["prompt_ids"])  # the dataset rendered them with the tools: the same ids
            return e
        text = self.tokenizer.apply_chat_template(e.messages, tools=self.schemas or None, tokenize=False,
                                                  add_generation_prompt=True)
        e.prompt_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(e.prompt_ids) > self.max_prompt_length:
            raise EnvironmentError_(f"{self.cfg.env}.reset() (row {row.get('source')}) returned messages of "
                                    f"{len(e.prompt_ids)} tokens with the tools, over data.max_prompt_length="
                                    f"{self.max_prompt_length}; raise data.max_prompt_length")
        return e

    def _model_turn(self, live: list[Episode], sampling: SamplingConfig, per_turn: int) -> None:
        budget = {id(e): self.max_response_length - len(e.ids) for e in live}
        cap = min(per_turn, max(budget.values()))
        out = self.engine.generate(Batch(fields={"prompt_ids": [e.context() for e in live]}, meta=dict(pad_id=self.pad_id)),
                                   dataclasses.replace(sampling, n=1, max_tokens=cap))
        mask, finished = out["response_mask"].bool(), out["finished"].bool()
        for k, e in enumerate(live):
            ids = out["responses"][k][mask[k]].tolist()
            lps = out["rollout_logprobs"][k][mask[k]].tolist()
            room = budget[id(e)]
            ended = bool(finished[k]) and len(ids) <= room
            ids, lps = ids[:room], lps[:room]
            e.add(ids, model=True, logprobs=lps)
            e.stats["turns"] += 1
            e.last_text = self.tokenizer.decode([t for t in ids if t not in self.eos_ids], skip_special_tokens=True)
            calls = parse_tool_calls(e.last_text, self.tool_names) if self.tool_names or "<tool_call>" in e.last_text else []
            e.messages.append({"role": "assistant", "content": e.last_text,
                               **({"tool_calls": [c.as_message() for c in calls if not c.error]} if calls else {})})
            e.pending_calls = calls
            if not ended:
                e.cut = "total_tokens" if len(ids) >= room else "turn_tokens"
        PROGRESS.beat()

    def _environment_turn(self, e: Episode) -> None:
        """The environment's step on the model's last turn and its tools' results; its reply appended."""
        turn = int(e.stats["turns"]) - 1
        where = f"{self.cfg.env}.step() (row {e.row.get('source')}, turn {turn + 1})"
        try:
            step = checked_step(e.env.step(Turn(e.last_text, e.pending_calls, list(e.results), turn)), where)
        except EnvironmentError_:
            raise
        except Exception as err:  # noqa: BLE001 -- counted like a reward error
            self._env_failed(e, f"step (turn {turn + 1})", err)
            return
        if step.reward is not None:
            e.env_reward += float(step.reward)
        if step.done:
            e.done = True
            return
        messages = [dict(m, content=printable(m["content"])) if isinstance(m.get("content"), str) else m
                    for m in step.messages]  # an environment's text may hold what UTF-8 cannot encode too
        reply = self.encoder.encode(messages)
        e.messages.extend(messages)
        if len(e.ids) + len(reply) >= self.max_response_length:  # no room for the reply and a turn after it
            e.cut = "total_tokens"
            return
        e.add(reply, model=False)

    def _submit_tools(self, e: Episode) -> None:
        """The model's last turn's calls: the unparsable ones answered now, the rest sent to the sandbox."""
        e.results = [None] * len(e.pending_calls)
        e.outstanding = 0
        for j, c in enumerate(e.pending_calls):
            e.stats["tool_calls"] += 1
            if c.error:
                self._record(e, j, ToolResult(c.name, f"error: {c.error}", status="error"))
            else:
                self._calls[self.sandbox.submit_call(c.name, c.arguments)] = (e, j)
                e.outstanding += 1

    def _collect_tools(self, block: bool) -> None:
        """The sandbox's finished calls into their episodes' results (``block``: wait for one)."""
        if not self._calls:
            return
        for key, o in self.sandbox.collect(block, on_result=PROGRESS.beat).items():
            if (entry := self._calls.pop(key, None)) is None:  # a call of a batch that raised
                continue
            e, j = entry
            self._record(e, j, self._tool_result(e.pending_calls[j], o))
            e.outstanding -= 1
        self._log_layers()

    def _tool_result(self, c: ToolCall, o) -> ToolResult:
        """The outcome as the model reads it: valid UTF-8, at most ``max_tool_output_tokens``."""
        if o.status == "ok":
            text, seconds = o.value
            r = ToolResult(c.name, text, "ok", seconds)
        elif o.status == "timeout":
            r = ToolResult(c.name, f"error: the call took longer than {self.cfg.tool_timeout:g}s and was stopped",
                           "timeout", self.cfg.tool_timeout)
        else:
            crashed = "worker process died" in o.detail
            detail = (f"the tool's process crashed ({o.detail.split('(')[-1].rstrip(')')})" if crashed
                      else o.detail.splitlines()[0][:500])
            r = ToolResult(c.name, f"error: {detail}", "crash" if crashed else "error")
        r.content = cut_to_tokens(self.tokenizer, printable(r.content), self.cfg.max_tool_output_tokens,
                                  self.encoder.added)
        return r

    @staticmethod
    def _record(e: Episode, j: int, r: ToolResult) -> None:
        e.results[j] = r
        e.stats["tool_seconds"] += r.seconds
        if r.status != "ok":
            e.stats[{"error": "tool_errors", "timeout": "tool_timeouts", "crash": "tool_crashes"}[r.status]] += 1

    def _log_layers(self) -> None:
        """Warn once when the kernel refused the sandbox's namespaces (the workers ran on only
        because every tool is safe without them, or ``allow_unconfined_tools`` said so)."""
        layers = self.sandbox.layers
        if self._logged_layers or not layers:
            return
        self._logged_layers = True
        missing = missing_layers(layers, self.cfg.tool_network)
        if missing:
            log.warning("tool sandbox: this machine refused the %s (no user namespaces); tools are bounded by %s "
                        "only, and a program one starts can read and write what this user can", ", ".join(missing),
                        ", ".join(layers))

    def _env_failed(self, e: Episode, method: str, err: Exception) -> None:
        e.cut = "env_error"
        if not self._logged_env_error:
            self._logged_env_error = True
            log.warning("environment %s raised in %s for row %s: %s: %s (the episode ends; counted in "
                        "agent/cut/env_error)", self.cfg.env, method, e.row.get("source"), type(err).__name__, err)

    def _check_errors(self, episodes: list[Episode]) -> None:
        failed = [e for e in episodes if e.cut == "env_error"]
        if episodes and len(failed) / len(episodes) > self.max_error_fraction:
            raise EnvironmentError_(
                f"environment {self.cfg.env} raised on {len(failed)} of {len(episodes)} episodes (more than "
                f"reward.max_error_fraction={self.max_error_fraction:g}), e.g. for row {failed[0].row.get('source')}: "
                "the class is broken, not unlucky (the first error is logged above)")

    # -- the batch -----------------------------------------------------------------------------

    def _batch(self, prompts: Batch, seqs: Batch, episodes: list[Episode]) -> Batch:
        prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in episodes], self.pad_id,
                                           max(len(e.prompt_ids) for e in episodes))
        width = max(1, max(len(e.ids) for e in episodes))
        responses, real = right_pad([e.ids or [self.pad_id] for e in episodes], self.pad_id, width)
        real = real * torch.tensor([[1] if e.ids else [0] for e in episodes])
        loss_mask, _ = right_pad([e.loss_mask or [0] for e in episodes], 0, width)
        logprobs = torch.zeros(len(episodes), width)
        for i, e in enumerate(episodes):
            logprobs[i, :len(e.logprobs)] = torch.tensor(e.logprobs, dtype=torch.float32)
        finished = torch.tensor([int(e.done) for e in episodes], dtype=torch.long)  # the environment ended it
        # attended: every real token of the episode; counted by the loss: the model's own
        out = rollout_batch(prompts, seqs, prompt_ids, prompt_mask, responses, real, loss_mask, finished, logprobs,
                            pad_id=self.pad_id, inputs=self.inputs)
        out.fields["prompt_ids"] = [e.prompt_ids for e in episodes]
        out.fields["response_text"] = [e.last_text for e in episodes]
        out.fields["conversation"] = [e.messages for e in episodes]
        out.fields["env_reward"] = [e.env_reward for e in episodes]
        out.fields["agent_stats"] = [{**e.stats, "cut": e.cut} for e in episodes]
        return out


def _limits(cfg: AgentConfig) -> SandboxLimits:
    return SandboxLimits(memory_bytes=cfg.memory_bytes(), network=cfg.tool_network,
                         max_output_chars=cfg.max_tool_output_chars, allow_unconfined=cfg.allow_unconfined_tools)


def agent_metrics(batch: Batch) -> dict[str, float]:
    """The step's ``agent/*`` figures from a rollout batch's ``agent_stats`` (none: {})."""
    if "agent_stats" not in batch.fields:
        return {}
    stats: list[dict[str, Any]] = batch["agent_stats"]
    n = max(len(stats), 1)
    out = {f"agent/{k}": sum(s[k] for s in stats) / n for k in ("turns", "tool_calls", "tool_seconds")}
    for k in ("tool_errors", "tool_timeouts", "tool_crashes"):
        out[f"agent/{k}"] = float(sum(s[k] for s in stats))
    for reason in CUT_REASONS:
        out[f"agent/cut/{reason}"] = sum(s["cut"] == reason for s in stats) / n
    out["agent/env_reward"] = sum(batch["env_reward"]) / n
    return out
