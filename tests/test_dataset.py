"""Tests for fitrl.data.dataset: file formats, error locations, prompt building, sampling."""

from __future__ import annotations

import json

import pytest

from fitrl.data.dataset import DataError, PromptDataset, PromptSampler, iter_rows

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ROWS = [
    {"prompt": "What is 1 + 2?", "answer": "3", "id": 0},
    {"prompt": "What is 10 - 4?", "answer": "6", "id": 1},
    {"prompt": "What is 7 * 6?", "answer": "42", "id": 2},
]


@pytest.fixture(scope="session")
def tokenizer():
    """A tiny byte-level BPE with ChatML special tokens, trained here (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["What is 1 + 2? The answer is 3.", "Compute 10 - 4 and 7 * 6.",
              "You are a careful assistant.", "user assistant system"] * 10
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHATML)


def make(files, tokenizer, **kw):
    opts = dict(prompt_key="prompt", answer_key="answer", max_prompt_length=512)
    opts.update(kw)
    return PromptDataset([str(f) for f in files], tokenizer, **opts)


def write_jsonl(path, rows, raw_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(raw_lines))
    return path


# ----------------------------------------------------------------------------------- formats


def test_every_format_loads_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "d.jsonl"
    # Blank lines are skipped and line numbers stay the real ones.
    jsonl.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n" + json.dumps(ROWS[2]) + "\n")
    json_list = tmp_path / "list.json"
    json_list.write_text(json.dumps(ROWS))
    json_data = tmp_path / "data.json"
    json_data.write_text(json.dumps({"data": ROWS, "version": 1}))
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))

    assert [s for s, _ in iter_rows(jsonl)] == [f"{jsonl}:1", f"{jsonl}:3", f"{jsonl}:4"]
    assert [s for s, _ in iter_rows(parquet)] == [f"{parquet}: row {i}" for i in range(3)]
    for path in (jsonl, json_list, json_data, parquet, saved):
        assert [row for _, row in iter_rows(path)] == ROWS, path


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(DataError, match="data file not found: .*nope.jsonl"):
        list(iter_rows(tmp_path / "nope.jsonl"))
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"d\.csv.*\.jsonl, \.json, \.parquet"):
        list(iter_rows(csv))


def test_bad_json_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS, ['{"prompt": "x" "answer": 1}\n'])
    with pytest.raises(DataError) as e:
        list(iter_rows(path))
    assert str(e.value) == f"{path}:4: invalid JSON (Expecting ',' delimiter: column 16)"


def test_bad_json_file_and_non_object_rows(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[\n{"prompt": "a"},\n{"prompt": }\n]')
    with pytest.raises(DataError, match=rf"{bad}:3: invalid JSON"):
        list(iter_rows(bad))
    lst = write_jsonl(tmp_path / "l.jsonl", [ROWS[0], [1, 2]])
    with pytest.raises(DataError, match=rf"{lst}:2: row is a list"):
        list(iter_rows(lst))
    obj = tmp_path / "o.json"
    obj.write_text(json.dumps({"rows": ROWS}))
    with pytest.raises(DataError, match="'data' list.*keys rows"):
        list(iter_rows(obj))


# ------------------------------------------------------------------------------ prompt building


def test_chat_prompt_ids_text_answer_extra(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    ds = make([path], tokenizer)
    assert len(ds) == 3 and ds.num_rows == 3 and ds.num_filtered == 0
    ex = ds[1]
    assert set(ex) == {"prompt_ids", "prompt_text", "prompt_messages", "answer", "extra", "source", "index"}
    assert ex["prompt_messages"] == [{"role": "user", "content": "What is 10 - 4?"}]  # (a reward model's input)
    assert ex["prompt_text"] == "<|im_start|>user\nWhat is 10 - 4?<|im_end|>\n<|im_start|>assistant\n"
    assert ex["prompt_ids"] == tokenizer(ex["prompt_text"], add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ex["prompt_ids"]) == ex["prompt_text"]
    assert (ex["answer"], ex["extra"], ex["source"], ex["index"]) == ("6", {"id": 1}, f"{path}:2", 1)
    ex["prompt_ids"].append(0)  # callers get copies
    assert ds[1]["prompt_ids"] != ex["prompt_ids"]


def test_plain_prompt_without_chat_template(tmp_path, tokenizer):
    ds = make([write_jsonl(tmp_path / "t.jsonl", ROWS)], tokenizer, apply_chat_template=False)
    assert ds[0]["prompt_text"] == "What is 1 + 2?"
    assert ds[0]["prompt_ids"] == tokenizer("What is 1 + 2?")["input_ids"]


def test_missing_prompt_column_names_the_columns(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [ROWS[0], ROWS[1], {"question": "q", "answer": "a"}])
    with pytest.raises(DataError) as e:
        make([path], tokenizer)
    assert str(e.value) == f"{path}:3: row has no 'prompt' column (columns: question, answer); set data.prompt_key"
    path = write_jsonl(tmp_path / "noans.jsonl", [{"prompt": "p"}])
    with pytest.raises(DataError, match=r"noans.jsonl:1: row has no 'answer' column .*data.answer_key"):
        make([path], tokenizer)


def test_jinja_template_renders_row_columns(tmp_path, tokenizer):
    rows = [{"question": "2 + 2", "unit": "apples", "answer": "4"}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    ds = make([path], tokenizer, prompt_key="question", prompt_template="Compute {{ question }} in {{ unit }}.")
    assert "<|im_start|>user\nCompute 2 + 2 in apples.<|im_end|>" in ds[0]["prompt_text"]
    assert ds[0]["extra"] == {"unit": "apples"}


def test_undefined_template_variable(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(DataError, match=rf"{path}:1: data.prompt_template .*'questoin' is undefined .*columns: prompt, answer, id"):
        make([path], tokenizer, prompt_template="Solve {{ questoin }}")
    with pytest.raises(DataError, match="syntax error"):
        make([path], tokenizer, prompt_template="Solve {{ prompt ")


def test_system_prompt_in_rendered_text(tmp_path, tokenizer):
    ds = make([write_jsonl(tmp_path / "t.jsonl", ROWS)], tokenizer, system_prompt="You are a careful assistant.")
    assert ds[0]["prompt_text"].startswith(
        "<|im_start|>system\nYou are a careful assistant.<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?")
    with pytest.raises(DataError, match="apply_chat_template=true"):
        make([tmp_path / "t.jsonl"], tokenizer, system_prompt="x", apply_chat_template=False)


def test_list_of_messages_prompt(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"},
            {"role": "assistant", "content": "2"}, {"role": "user", "content": "and 2 + 2?"}]
    path = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": conv, "answer": "4"}]), path)
    ds = make([path], tokenizer)
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conv) + "<|im_start|>assistant\n"
    assert ds[0]["prompt_text"] == expected
    assert ds[0]["source"] == f"{path}: row 0"
    with pytest.raises(DataError, match="already has a system message"):
        make([path], tokenizer, system_prompt="Other.")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": [{"role": "user"}], "answer": "1"}])
    with pytest.raises(DataError, match=r"bad.jsonl:1: 'prompt' is a list but not of"):
        make([bad], tokenizer)


def test_length_filter_counts_and_summary(tmp_path, tokenizer):
    rows = ROWS + [{"prompt": "What is 1 + 2? " * 20, "answer": "3", "id": 3}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    full = make([path], tokenizer)
    lengths = [len(full[i]["prompt_ids"]) for i in range(4)]
    limit = max(lengths[:3])
    ds = make([path, path], tokenizer, max_prompt_length=limit)
    assert (len(ds), ds.num_rows, ds.num_filtered) == (6, 8, 2)
    assert [ds[i]["index"] for i in range(len(ds))] == list(range(6))
    short = lengths[:3]
    mean = sum(short) / 3
    assert ds.summary() == (f"train: 6 prompts from 2 files ({2} longer than {limit} tokens dropped); "
                            f"prompt tokens min/mean/max {min(short)}/{mean:.1f}/{max(short)}")
    assert "dropped" not in full.summary() and "from 1 file;" in full.summary()


def test_all_rows_filtered_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", ROWS)
    lengths = sorted(len(make([path], tokenizer)[i]["prompt_ids"]) for i in range(3))
    with pytest.raises(DataError) as e:
        make([path], tokenizer, max_prompt_length=lengths[0] - 1)
    msg = str(e.value)
    assert "all 3 rows" in msg and f"shortest {lengths[0]}, longest {lengths[-1]}" in msg
    assert "raise data.max_prompt_length" in msg


# ---------------------------------------------------------------------------------- sampling


def draw(sampler, steps):
    return [sampler.next_indices() for _ in range(steps)]


def test_sampler_is_deterministic_and_seeded():
    assert draw(PromptSampler(10, 4, True, seed=3), 8) == draw(PromptSampler(10, 4, True, seed=3), 8)
    assert draw(PromptSampler(10, 4, True, seed=3), 8) != draw(PromptSampler(10, 4, True, seed=4), 8)
    assert draw(PromptSampler(5, 2, False, seed=0), 3) == [[0, 1], [2, 3], [4, 0]]


def test_each_epoch_is_a_permutation_and_batches_span_epochs():
    size, bs = 7, 3
    s = PromptSampler(size, bs, shuffle=True, seed=1)
    flat = [i for batch in draw(s, 7) for i in batch]  # 21 indices = exactly 3 epochs
    epochs = [flat[k * size:(k + 1) * size] for k in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(size))
    assert epochs[0] != epochs[1]  # a fresh permutation per epoch
    assert s.epoch == 3
    big = PromptSampler(3, 8, shuffle=True, seed=0)  # batch larger than the data wraps
    batch = big.next_indices()
    assert len(batch) == 8 and sorted(batch[:3]) == [0, 1, 2] and sorted(batch[3:6]) == [0, 1, 2]
    assert big.epoch == 2


def test_sampler_resumes_from_state_dict():
    ref = PromptSampler(11, 4, True, seed=5)
    expected = draw(ref, 10)
    s = PromptSampler(11, 4, True, seed=5)
    draw(s, 4)  # mid-epoch (16 = 1 epoch + 5)
    state = json.loads(json.dumps(s.state_dict()))  # survives a checkpoint round-trip
    resumed = PromptSampler(11, 4, True, seed=5)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    assert draw(resumed, 6) == expected[4:]
    with pytest.raises(ValueError, match="size=11"):
        PromptSampler(12, 4, True, seed=5).load_state_dict(state)
