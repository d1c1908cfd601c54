"""The calculator task of the agent demo (``fitrl demo --tools``, examples/mul_tools.yaml,
docs/agents.md): ``What is 37 * 43? Use the calculator.`` for two-digit factors, which a tiny
model cannot multiply but can answer by calling the calculator and copying its reply.

:func:`write_mul_tools_data` writes three files:

- ``mul_tools_val.jsonl``: 40 held-out products, the GRPO run's validation;
- ``mul_tools_train.jsonl``: 4000 other products, GRPO's prompts (the product as the answer);
- ``mul_tools_sft.jsonl``: the warm start, two rows for each of the first ``DEMONSTRATIONS``
  train products: the question answered by the call (as the chat template writes one), and the
  conversation through the calculator's reply answered by the number.

So many products that neither stage can memorise them: what the model learns is to copy the
operands into the call and the reply into the answer. Deterministic for a seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PHRASING = "What is {a} * {b}? Use the calculator."
TRAIN, VAL, DEMONSTRATIONS = 4000, 40, 1000


def tool_call(a: int, b: int) -> str:
    """The call as the model writes it (the Hermes format of fitrl/agents/tools.py)."""
    call = {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def write_mul_tools_data(out_dir, seed: int = 0) -> None:
    out = Path(out_dir)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    val, train = pairs[:VAL], pairs[VAL:VAL + TRAIN]
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("mul_tools_train.jsonl", train), ("mul_tools_val.jsonl", val)):
        with open(out / name, "w") as f:
            for a, b in rows:
                f.write(json.dumps({"prompt": PHRASING.format(a=a, b=b), "answer": a * b}) + "\n")
    with open(out / "mul_tools_sft.jsonl", "w") as f:
        for a, b in train[:DEMONSTRATIONS]:
            question = {"role": "user", "content": PHRASING.format(a=a, b=b)}
            f.write(json.dumps({"prompt": [question], "answer": tool_call(a, b)}) + "\n")
            conversation = [question, {"role": "assistant", "content": tool_call(a, b)},
                            {"role": "tool", "content": str(a * b)}]
            f.write(json.dumps({"prompt": conversation, "answer": str(a * b)}) + "\n")
