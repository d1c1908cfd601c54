"""The reward of the agent demo (examples/mul_tools.yaml): the last turn's number against the
product, with credit for each digit in its place, so that reading the calculator's reply a
little better pays before reading all of it does.

>>> product_reward("1591", 1591)
{'score': 1.0, 'digits': 1.0, 'exact': 1.0}
>>> product_reward("1581", 1591)
{'score': 0.225, 'digits': 0.75, 'exact': 0.0}
>>> product_reward("<tool_call>", 1591)
{'score': 0.0, 'digits': 0.0, 'exact': 0.0}
"""


def product_reward(response: str, answer, *, digits_weight: float = 0.3, exact_weight: float = 0.7) -> dict:
    text, target = response.strip(), str(int(answer))
    if not text.isdigit():
        return {"score": 0.0, "digits": 0.0, "exact": 0.0}
    digits = sum(x == y for x, y in zip(text, target)) / max(len(text), len(target))
    exact = float(text == target)
    return {"score": round(digits_weight * digits + exact_weight * exact, 6), "digits": round(digits, 6),
            "exact": exact}
