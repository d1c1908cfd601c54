"""Supervised fine-tuning batches (``fitrl sft``): each prompt followed by its target, the rows'
answer column as text, ending with the token that ends a response (so the warm-started policy
stops where the rollout stops it); or, for rows in TRL's conversational formats (``messages``,
``prompt``/``completion``), the conversation through the chat template with the loss on the
assistant turns only (:func:`conversation_format`, :func:`chat_target`).

The batch has the rollout's layout (fitrl/rollout/layout.py): left-padded prompts, right-padded
responses, ``response_mask`` over the target tokens, so the actor's micro-batching, log-prob
chunks and FSDP2 passes serve supervised steps unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from fitrl.core.errors import DataError
from fitrl.core.padding import left_pad, right_pad
from fitrl.data.batch import Batch
from fitrl.data.rows import kind_of

MESSAGES, COMPLETION = "messages", "completion"
"""TRL's column names: conversational rows (``messages``) and prompt-completion rows (``completion``)."""


@dataclass(frozen=True)
class ChatTarget:
    """The target of a conversational row: the tokens after its prompt, rendered by the chat
    template, and which of them the loss covers (1: an assistant turn's content and the template's
    end-of-turn token; 0: the user, system and tool turns between them). ``str()`` is the last
    assistant turn's content (what a reward compares, what people read)."""
    ids: list[int]
    mask: list[int]
    text: str

    def __str__(self) -> str:
        return self.text


def conversation_format(row: dict, prompt_key: str, answer_key: str) -> Optional[str]:
    """The TRL format a row is in, from its columns: ``messages`` (a ``messages`` column and no
    prompt column), ``completion`` (a ``completion`` column and no answer column; or the answer
    column is ``completion`` and holds messages), or None (fitrl's prompt/answer rows).

    >>> conversation_format({"messages": []}, "prompt", "answer"), conversation_format({"prompt": "", "completion": ""}, "prompt", "answer")
    ('messages', 'completion')
    >>> conversation_format({"prompt": "", "completion": [{"role": "assistant", "content": "5"}]}, "prompt", "completion")
    'completion'
    """
    if not answer_key:  # rows without answers (fitrl.train with rewards that read none): prompts, not targets
        return None
    if MESSAGES in row and prompt_key not in row:
        return MESSAGES
    if COMPLETION in row and prompt_key in row and (
            answer_key not in row or answer_key == COMPLETION and isinstance(row[COMPLETION], list)):
        return COMPLETION
    return None


def _checked_messages(source: str, column: str, value: Any) -> list[dict]:
    """``value`` as a list of ``{'role', 'content'}`` messages with string content."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{source}: {column!r} is {kind_of(value) if value != [] else 'an empty list'}; "
                        f"expected text or a list of {{'role', 'content'}} messages; fix or remove the row")
    for m in value:
        if not (isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool")
                and isinstance(m.get("content"), str)):
            raise DataError(f"{source}: {column!r} has a message that is not {{'role': system|user|assistant|tool, "
                            f"'content': str}}: {m!r}; fix or remove the row")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def conversation(source: str, row: dict, fmt: str, prompt_key: str) -> tuple[list[dict], int]:
    """A conversational row's messages and the index of the first turn the loss may cover: for
    ``messages``, its first assistant turn (every assistant turn from there on is trained); for
    ``completion``, the first of the completion's messages (a string completion is one assistant
    turn; a string prompt one user turn). Refuses, naming the row, a conversation with no
    assistant turn to train on and an empty assistant turn."""
    if fmt == MESSAGES:
        messages = _checked_messages(source, MESSAGES, row[MESSAGES])
        start = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if start is None:
            raise DataError(f"{source}: {MESSAGES!r} has no assistant turn to train on; add one or remove the row")
    else:
        prompt, completion = row[prompt_key], row[COMPLETION]
        messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) and prompt
                    else _checked_messages(source, prompt_key, prompt))
        start = len(messages)
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        messages += _checked_messages(source, COMPLETION, completion)
        if not any(m["role"] == "assistant" for m in messages[start:]):
            raise DataError(f"{source}: {COMPLETION!r} has no assistant turn to train on; fix or remove the row")
    for m in messages[start:]:
        if m["role"] == "assistant" and not m["content"].strip():
            raise DataError(f"{source}: an assistant turn is empty, nothing to train on; fix or remove the row")
    return messages, start


def chat_target(tokenizer: Any, messages: list[dict], start: int, source: str,
                tools: Optional[list[dict]] = None) -> tuple[str, ChatTarget]:
    """The prompt text (``messages[:start]`` with the generation prompt) and the target after it.

    Each assistant turn from ``start`` on is located by rendering the conversation up to it with
    the generation prompt and through it: what the second adds to the first is the turn, its
    content (and the reasoning or other text a template writes before it) trained, then the
    template's end-of-turn token if it writes a special one (``<|im_end|>``), so the policy learns
    to stop; the text between assistant turns is context (mask 0). Trailing context is dropped.
    A template that rewrites earlier turns when later ones follow (Qwen3's drops past reasoning)
    cannot be split this way and is refused."""
    def render(upto: int, generation: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tools=tools, add_generation_prompt=generation,
                                             tokenize=False)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    special = set(tokenizer.all_special_ids)
    prompt = done = render(start, True)
    ids: list[int] = []
    mask: list[int] = []
    for i in range(start, len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        before, through = render(i, True), render(i + 1, False)
        if not (before.startswith(done) and through.startswith(before)):
            raise DataError(f"{source}: the chat template renders the conversation's turns differently once later "
                            f"turns follow, so its assistant turns cannot be located; use prompt/answer rows "
                            f"(one target per row) for this model")
        turn, content = through[len(before):], messages[i]["content"]
        at = turn.find(content)
        if at < 0:  # (a template that strips the content)
            content = content.strip()
            at = turn.find(content)
        if at < 0:
            raise DataError(f"{source}: the chat template does not write assistant turn {i}'s content as given; "
                            f"use prompt/answer rows for this model")
        context = encode(before[len(done):])
        reply, tail = encode(turn[:at + len(content)]), encode(turn[at + len(content):])
        end = 1 if tail and tail[0] in special else 0
        ids += context + reply + tail
        mask += [0] * len(context) + [1] * (len(reply) + end) + [0] * (len(tail) - end)
        done = through
    last = max(j for j, m in enumerate(mask) if m) + 1
    return prompt, ChatTarget(ids[:last], mask[:last], messages[max(j for j, m in enumerate(messages)
                                                                   if m["role"] == "assistant")]["content"])


def bad_target(answer: Any) -> Optional[str]:
    """Why ``answer`` cannot be a supervised target (None: it can): a missing or empty answer
    would train on the text ``None`` or on the end token alone, and a list or a mapping on its
    Python repr.

    >>> bad_target(8), bad_target(None), bad_target(""), bad_target({"a": 1}), bad_target(float("nan"))
    (None, 'is null', 'is empty', 'is an object, not text or a number', 'is nan, not a finite number')
    """
    if isinstance(answer, ChatTarget):
        return None
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):  # (JSON's NaN and Infinity: no sum)
        return None if math.isfinite(answer) else f"is {answer}, not a finite number"
    if answer is None:
        return "is null"
    if isinstance(answer, str):
        return None if answer.strip() else "is empty"
    if isinstance(answer, list) and answer and all(isinstance(m, dict) and "role" in m for m in answer):
        return "is a list (of chat messages: put them in a completion column, TRL's prompt-completion format)"
    return f"is {kind_of(answer)}, not text or a number"


def target_text(answer: Any) -> str:
    """The target of a row: its answer column as text (a number as it prints: 8, 2.5). The
    start-up check (:func:`bad_target`) has refused the answers that have no text."""
    why = bad_target(answer)
    if why is not None:
        raise ValueError(f"a supervised target {why}: {answer!r}")
    return answer if isinstance(answer, str) else str(answer)


def target_ids(answers: list[Any], tokenizer: Any, end_id: int, max_length: int) -> list[list[int]]:
    """Each answer's token ids and ``end_id``, cut to ``max_length`` tokens (a target cut short
    loses its end token, as a response at the length limit does); a conversational row's target
    (:class:`ChatTarget`) is its rendered ids, cut the same way."""
    plain = [a for a in answers if not isinstance(a, ChatTarget)]
    encoded = iter(tokenizer([target_text(a) for a in plain], add_special_tokens=False)["input_ids"] if plain else [])
    return [(list(a.ids) if isinstance(a, ChatTarget) else list(next(encoded)) + [end_id])[:max_length]
            for a in answers]


def target_lengths(answers: list[Any], tokenizer: Any) -> list[int]:
    """Each answer's target length in tokens, its end token included (before any cut)."""
    plain = [target_text(a) for a in answers if not isinstance(a, ChatTarget)]
    encoded = iter(tokenizer(plain, add_special_tokens=False)["input_ids"] if plain else [])
    return [len(a.ids) if isinstance(a, ChatTarget) else len(next(encoded)) + 1 for a in answers]


def supervised_batch(prompts: Batch, targets: list[list[int]], pad_id: int) -> Batch:
    """``prompts`` (a dataset batch: ``prompt_ids`` per row) with ``targets`` as their responses:
    ``input_ids`` / ``attention_mask`` (B, P+R), ``responses`` / ``response_mask`` (B, R); the
    prompts' fields are kept (a vision-language row's images travel with it). A conversational
    row's ``response_mask`` is its target's loss mask (its user turns attended, not trained)."""
    prompt_ids, prompt_mask = left_pad(prompts["prompt_ids"], pad_id, max(len(p) for p in prompts["prompt_ids"]))
    responses, real = right_pad(targets, pad_id, max(len(t) for t in targets))  # (B, R)
    loss_mask = [a.mask[:len(t)] if isinstance(a, ChatTarget) else [1] * len(t)
                 for a, t in zip(prompts["answer"], targets)]
    response_mask, _ = right_pad(loss_mask, 0, responses.shape[1])
    response_mask = response_mask.to(real.dtype) * real
    return Batch(tensors={"input_ids": torch.cat([prompt_ids, responses], 1),
                          "attention_mask": torch.cat([prompt_mask, real], 1),
                          "responses": responses, "response_mask": response_mask},
                 fields=dict(prompts.fields), meta=dict(prompts.meta))
