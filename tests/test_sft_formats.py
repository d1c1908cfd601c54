"""``fitrl sft`` on TRL's formats (fitrl/data/supervised.py, fitrl/trainer/sft.py): ``messages``
and ``prompt``/``completion`` rows through the chat template with the loss on the assistant turns
only, bad rows in one line, a default learning rate that trains, and a warning when it does not."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys

import pytest

QUIET = ["trainer.val_freq=0", "trainer.val_before_train=false", "checkpoint.save_freq=0",
         "checkpoint.save_final=false", "trainer.progress_bar=false", "memory.plan=off", "trainer.num_threads=2",
         "data.rollout_batch_size=8", "actor.mini_batch_size=8", "rollout.max_response_length=16"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sums(n=64, seed=0):
    rng = random.Random(seed)
    return [(a, b) for a, b in ((rng.randrange(10), rng.randrange(10)) for _ in range(n))]


def sft(tiny_model_dir, run_dir, files, *overrides):
    """A supervised run from schema defaults (no example's learning rate) and its console text."""
    from rich.console import Console

    from fitrl.config.loader import load_config
    from fitrl.trainer.run import train

    cfg = load_config(None, [f"actor.model.path={tiny_model_dir}", f"trainer.run_dir={run_dir}",
                             f"data.train_files=[{files}]", *QUIET, *overrides])
    out = io.StringIO()
    history = train(cfg, console=Console(file=out, width=400), supervised=True)
    return [h["sft/nll"] for h in history], out.getvalue()


def test_a_messages_jsonl_trains_at_the_default_lr_without_a_warning(tiny_model_dir, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                          {"role": "assistant", "content": str(a + b)}]} for a, b in sums()]
    nll, console = sft(tiny_model_dir, tmp_path / "run", write_jsonl(tmp_path / "m.jsonl", rows), "trainer.max_steps=30")
    assert "actor.optim.lr=5e-05 (fitrl sft's default" in console
    assert sum(nll[-3:]) / 3 < 0.95 * sum(nll[:3]) / 3, nll  # (measured: 6.25 -> 5.78)
    assert "has not moved" not in console


def test_a_tiny_lr_warns_naming_the_key(tiny_model_dir, tmp_path):
    rows = [{"prompt": f"What is {a} + {b}?", "completion": str(a + b)} for a, b in sums()]
    _, console = sft(tiny_model_dir, tmp_path / "run", write_jsonl(tmp_path / "pc.jsonl", rows),
                     "trainer.max_steps=20", "actor.optim.lr=1e-8")
    line, = [x for x in console.splitlines() if "has not moved" in x]
    assert "actor.optim.lr=1e-08" in line and "fitrl sft's default is 5e-05" in line


def test_the_mask_covers_the_assistant_turns_only(tiny_model_dir):
    """A two-turn conversation rendered by the tiny Qwen2 template, checked token by token."""
    from fitrl.data.supervised import chat_target, conversation
    from fitrl.models.loading import load_local_tokenizer

    tok = load_local_tokenizer(str(tiny_model_dir))
    row = {"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2"},
                        {"role": "assistant", "content": "3"}, {"role": "user", "content": "and 4+4"},
                        {"role": "assistant", "content": "8"}]}
    messages, start = conversation("f:1", row, "messages", "prompt")
    assert start == 2
    prompt, target = chat_target(tok, messages, start, "f:1")
    assert prompt == "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n1+2<|im_end|>\n<|im_start|>assistant\n"
    pieces = [(t, m) for t, m in zip(tok.convert_ids_to_tokens(target.ids), target.mask)]
    trained = "".join(t for t, m in pieces if m)
    context = "".join(t for t, m in pieces if not m)
    assert trained == "3<|im_end|>8<|im_end|>"
    assert context == "Ċ<|im_start|>userĊandĠ4+4<|im_end|>Ċ<|im_start|>assistantĊ"  # (Ċ, Ġ: newline, space)
    assert str(target) == "8" and len(target.ids) == len(target.mask)


def test_prompt_completion_rows_and_their_batch(tiny_model_dir, tmp_path):
    """String and message prompts and completions; the batch attends the context, trains the reply."""
    from fitrl.data.dataset import PromptDataset
    from fitrl.data.supervised import ChatTarget, supervised_batch, target_ids
    from fitrl.models.loading import load_local_tokenizer

    tok = load_local_tokenizer(str(tiny_model_dir))
    f = write_jsonl(tmp_path / "pc.jsonl", [
        {"prompt": "1+2", "completion": "3", "level": 1},
        {"prompt": [{"role": "user", "content": "1+2"}], "completion": [{"role": "assistant", "content": "3"}]},
        {"messages": [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"},
                      {"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]}])
    ds = PromptDataset([f], tok, prompt_key="prompt", answer_key="answer", max_prompt_length=64)
    a, b, c = ds[0], ds[1], ds[2]
    assert a["prompt_ids"] == b["prompt_ids"] == c["prompt_ids"] and a["answer"] == b["answer"]
    assert isinstance(a["answer"], ChatTarget) and a["extra"] == {"level": 1} and "messages" not in c["extra"]
    assert a["answer"].ids == tok("3<|im_end|>", add_special_tokens=False)["input_ids"] and a["answer"].mask == [1, 1]
    batch = ds.batch([0, 2], tag="t")
    targets = target_ids(batch["answer"], tok, tok.eos_token_id, max_length=64)
    out = supervised_batch(batch, targets, pad_id=tok.pad_token_id)
    R = out["responses"].shape[1]
    assert out["response_mask"][0].tolist() == [1, 1] + [0] * (R - 2)
    assert out["response_mask"][1].tolist() == c["answer"].mask
    assert out["attention_mask"][1, -R:].tolist() == [1] * R  # the second user turn is attended, not trained


def test_bad_targets_are_refused_naming_the_row_and_long_ones_counted(tiny_model_dir):
    from fitrl.core.errors import DataError
    from fitrl.data.supervised import ChatTarget, conversation
    from fitrl.models.loading import load_local_tokenizer
    from fitrl.trainer.sft import check_targets

    tok = load_local_tokenizer(str(tiny_model_dir))
    for answer, says in ((None, "is null"), ("  ", "is empty"),
                         ([{"role": "assistant", "content": "3"}], "put them in a completion column")):
        with pytest.raises(DataError, match=f"^d.jsonl:2: the answer .* {says}"):
            check_targets([3, answer], ["d.jsonl:1", "d.jsonl:2"], tok, max_length=8)
    note = check_targets(["3", ChatTarget(list(range(12)), [1] * 12, "x")], ["a", "b"], tok, max_length=8)
    assert note.startswith("1 of 2 supervised targets are longer than rollout.max_response_length=8 tokens (longest 12)")
    assert check_targets(["3"], ["a"], tok, max_length=8) is None
    with pytest.raises(DataError, match="^f:3: 'messages' has no assistant turn"):
        conversation("f:3", {"messages": [{"role": "user", "content": "hi"}]}, "messages", "prompt")
    with pytest.raises(DataError, match="^f:4: 'completion' has a message that is not"):
        conversation("f:4", {"prompt": "hi", "completion": [["not", "a", "message"]]}, "completion", "prompt")


@pytest.mark.cli
def test_a_row_without_an_assistant_turn_is_one_line_exit_2(tiny_model_dir, tmp_path):
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "yo"}]},
                                           {"messages": [{"role": "user", "content": "hi"}]}])
    proc = subprocess.run([sys.executable, "-m", "fitrl.cli", "sft", "examples/arith.yaml",
                           f"actor.model.path={tiny_model_dir}", f"trainer.run_dir={tmp_path / 'run'}",
                           f"data.train_files=[{f}]", "data.val_files=[]", "memory.plan=off"],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert f"{f}:2: 'messages' has no assistant turn to train on" in proc.stderr and "Traceback" not in proc.stderr
