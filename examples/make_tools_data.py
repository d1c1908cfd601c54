"""Writes the calculator task of the agent example (examples/mul_tools.yaml, ``fitrl demo
--tools``, docs/agents.md): ``What is 37 * 43?`` for two-digit factors, which a tiny model cannot
multiply but can answer by calling the calculator and reading its reply.

- ``mul_tools_train.jsonl`` (800 products) and ``mul_tools_val.jsonl`` (40 held-out ones): the
  GRPO task, the product as the answer;
- ``mul_tools_sft.jsonl``, the warm start: for each of DEMONSTRATIONS train products, two rows
  (the question answered by the call, as the chat template writes one; the conversation through
  the calculator's reply answered by the number).

Run: python examples/make_tools_data.py  (the files it writes are committed; this documents them)
"""

import json
import random
from pathlib import Path

PHRASING = "What is {a} * {b}? Use the calculator."
DEMONSTRATIONS = 400


def tool_call(a: int, b: int) -> str:
    call = {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def main(out_dir: Path = Path(__file__).parent / "data", seed: int = 0) -> None:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    train, val = pairs[:800], pairs[800:840]
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("mul_tools_train.jsonl", train), ("mul_tools_val.jsonl", val)):
        with open(out_dir / name, "w") as f:
            for a, b in rows:
                f.write(json.dumps({"prompt": PHRASING.format(a=a, b=b), "answer": a * b}) + "\n")
    with open(out_dir / "mul_tools_sft.jsonl", "w") as f:
        for a, b in train[:DEMONSTRATIONS]:
            question = {"role": "user", "content": PHRASING.format(a=a, b=b)}
            f.write(json.dumps({"prompt": [question], "answer": tool_call(a, b)}) + "\n")
            conversation = [question, {"role": "assistant", "content": tool_call(a, b)},
                            {"role": "tool", "content": str(a * b)}]
            f.write(json.dumps({"prompt": conversation, "answer": str(a * b)}) + "\n")


if __name__ == "__main__":
    main()
