"""The toy task's tiny reward model: a random-initialised qwen2 sequence classifier taught to
predict the ``arith`` rule's score of a response, so that GRPO can learn from a model's scores
(``fitrl demo --reward-model``, examples/arith_rm.yaml; docs/reward-models.md).

    .venv/bin/fitrl make-tiny-model .cache/models/tiny-rm-arith --head reward --train-on arith   # ~2 min

Each train prompt comes with every number its sum can be (0-18) and what a young policy writes
besides: far misses, digits past the length limit, words, nothing; each response labelled with
``arith_reward``'s score. A step regresses (MSE, AdamW) the scores of all the responses of a few
prompts at once, read as the reward-model role reads them (prompt + response through the
model's own chat template, the score at the last token: fitrl/roles/model_reward.py). Seeing a
prompt's right sum beside its wrong ones is what teaches the sums: responses sampled one by one
teach mostly "a short number scores well", and a policy paid by such a model learns one
constant number (tried: validation exact match fell from 0.25 to 0). The figures returned (and
written to ``fitrl_reward_model.json``): how often the right sum outranks every other number on
the train and on the held-out prompts, the held-out correlation with the rule, and the mean
score per kind of response.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
KINDS = ("right", "near", "far", "long digits", "words", "empty")
LARGEST_SUM = 18  # the task's sums are of two digits 0-9


def responses(answer: int, rng: random.Random) -> list[tuple[str, str]]:
    """(kind, response) pairs for one prompt: every number the sum can be (the right one first),
    then what a young policy writes besides numbers."""
    numbers = [("right", str(answer))] + [("near" if abs(v - answer) <= 2 else "far", str(v))
                                          for v in range(LARGEST_SUM + 1) if v != answer]
    return numbers + [
        ("far", str(answer + rng.choice([-1, 1]) * rng.randint(20, 90))),
        ("long digits", "".join(rng.choice("0123456789") for _ in range(rng.randint(5, 8)))),
        ("long digits", str(answer) * rng.randint(3, 4)),
        ("words", rng.choice(["the answer", "I think so", "what?", "sum", "<b>", "x = 7"])),
        ("empty", "")]


def groups(path: Path, seed: int) -> list[list[dict]]:
    """One group of labelled responses per prompt of the file (labels: ``arith_reward``'s score)."""
    from fitrl.rewards.arith import arith_reward

    rng = random.Random(seed)
    out = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out.append([{"messages": [{"role": "user", "content": row["prompt"]}], "response": response,
                     "kind": kind, "label": arith_reward(response, row["answer"])["score"]}
                    for kind, response in responses(int(row["answer"]), rng)])
    return out


def encode(tokenizer, rows: list[dict]) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template(r["messages"] + [{"role": "assistant", "content": r["response"]}],
                                           tokenize=False) for r in rows]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def scores(model, seqs: list[list[int]], pad: int) -> torch.Tensor:
    from fitrl.core.padding import right_pad
    from fitrl.ops.score import last_token_scores

    ids, mask = right_pad(seqs, pad, max(map(len, seqs)))
    return last_token_scores(model, ids, mask)


def ranking(model, group_ids: list[list[list[int]]], pad: int) -> float:
    """Share of the prompts whose right sum scores above every other number."""
    with torch.no_grad():
        return sum(int(scores(model, ids[:LARGEST_SUM + 1], pad).argmax() == 0) for ids in group_ids) / len(group_ids)


def train_arith_reward_model(out_dir, seed: int = 0, steps: int = 1000, prompts_per_step: int = 4,
                             lr: float = 2e-3) -> dict:
    """Writes the trained reward model to ``out_dir``; returns the train and held-out figures."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from fitrl.models.tiny import make_tiny_model

    out = make_tiny_model(out_dir, size="tiny", seed=seed, head="reward")
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSequenceClassification.from_pretrained(out)
    pad = tokenizer.pad_token_id
    train, held_out = groups(DATA / "arith_train.jsonl", seed), groups(DATA / "arith_val.jsonl", seed + 1)
    train_ids, held_ids = [encode(tokenizer, g) for g in train], [encode(tokenizer, g) for g in held_out]
    train_labels = [torch.tensor([r["label"] for r in g]) for g in train]
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for step in range(steps):  # a step: every response of a few prompts, so it compares their numbers
        pick = torch.randint(len(train_ids), (prompts_per_step,)).tolist()
        got = scores(model, [seq for i in pick for seq in train_ids[i]], pad)
        loss = torch.nn.functional.mse_loss(got, torch.cat([train_labels[i] for i in pick]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    rows = [r for g in held_out for r in g]
    with torch.no_grad():
        got = scores(model, [s for ids in held_ids for s in ids], pad)
    want = torch.tensor([r["label"] for r in rows])
    corr = torch.corrcoef(torch.stack([got, want]))[0, 1].item()
    by_kind = {k: round(got[[i for i, r in enumerate(rows) if r["kind"] == k]].mean().item(), 3) for k in KINDS}
    model.save_pretrained(out)
    figures = {"held_out_pairs": len(rows), "held_out_correlation": round(corr, 3),
               "train_right_sum_ranked_first": round(ranking(model, train_ids, pad), 3),
               "held_out_right_sum_ranked_first": round(ranking(model, held_ids, pad), 3),
               "mean_score_by_kind": by_kind}
    (Path(out) / "fitrl_reward_model.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures
