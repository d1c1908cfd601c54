"""Rule rewards: plain functions over text returning the total and its components.

answers    final-answer extraction (boxed, markers, tags, choice letters) and math-verify equivalence
rules      the built-in math, r1v (geometry / multiple choice) and think-format rewards
arith      the toy arithmetic task's reward
choice     one-option answers (a word, digit or letter out of a few) with spelling partial credit: the shapes task's reward
functions  built-in names and ``file.py:fn`` / ``module:fn`` references, signature and result checks
pool       worker processes with a per-call wall-clock limit (kill and replace on timeout)
(the role that scores a batch, RewardScorer, is fitrl/roles/reward.py: scores and components out,
           failures counted and logged)
"""

CORRECT_COMPONENTS = ("accuracy", "exact")
"""Reward components that say whether an answer is right, first found wins: validation's @n
accuracy (unless ``reward.correct_key`` names another) and the report's accuracy chart read them."""
