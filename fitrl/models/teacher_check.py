"""The teacher of on-policy distillation against its student, before anything heavy loads.

The teacher scores the student's own token ids (fitrl/roles/teacher.py), so an id must mean the
same text to both: a teacher with another tokenizer would be scored on garbage and train the
student toward it without a word. Cross-tokenizer distillation is out of scope; a mismatch is one
line naming both directories (:func:`check_same_tokenizer`). The teacher's top-k ids index the
student's vocabulary, so ``algorithm.distill.top_k`` is bounded by the smaller of the two
(:func:`check_topk_fits`). Called from fitrl/models/check.py with the configs it read.
"""

from __future__ import annotations

from fitrl.core.errors import ConfigError, ModelDirError

PROBES = ("What is 12 + 30? Answer with a number.", " The quick brown fox jumps over the lazy dog.",
          "def f(x):\n    return [x, x ** 2]  # 3.14\n", "Ünïcödé 漢字 🙂 naïve café")
"""Texts whose ids two tokenizers must agree on: words, digits and spacing, code, non-ASCII bytes
(equal vocabularies with different merges or normalisers split these differently)."""


def where_tokenizer(model) -> str:
    """The directory a model's tokenizer is read from."""
    return model.tokenizer_path or model.path


def check_topk_fits(cfg, vocab: int) -> None:
    """``algorithm.distill.top_k`` within ``vocab``, the smaller of the teacher's and the actor's
    ``config.json`` ``vocab_size`` (a teacher's padded embedding may have more rows than the
    student's, and its top-k ids index the student's)."""
    from fitrl.algo.distill import check_topk  # (torch: only once the config.json checks passed)

    k = cfg.algorithm.distill.top_k
    if not k:
        return
    try:
        check_topk(k, vocab)
    except ValueError as e:
        raise ConfigError(f"algorithm.distill.top_k={k}: {e} (the smaller of teacher.model.path="
                          f"{cfg.teacher.model.path!r} and actor.model.path={cfg.actor.model.path!r})") from None


def tokenizer_difference(student, teacher) -> str:
    """Why two loaded tokenizers differ ("" when they agree): their sizes, their vocabularies
    (token -> id), or the ids of a probe text (:data:`PROBES`)."""
    if len(student) != len(teacher):
        return f"{len(teacher)} tokens against the actor's {len(student)}"
    sv, tv = student.get_vocab(), teacher.get_vocab()
    differ = [t for t in sv if tv.get(t) != sv[t]]
    if differ:
        return f"{len(differ)} of {len(sv)} tokens have other ids (e.g. {differ[0]!r}: {tv.get(differ[0])} against {sv[differ[0]]})"
    for text in PROBES:
        a = student(text, add_special_tokens=False)["input_ids"]
        b = teacher(text, add_special_tokens=False)["input_ids"]
        if a != b:
            return f"{text!r} is {len(b)} ids against the actor's {len(a)} ({b[:6]} against {a[:6]})"
    return ""


def check_same_tokenizer(cfg, student, teacher) -> None:
    """A :class:`ModelDirError` naming both tokenizer directories when the teacher's tokenizer is
    not the actor's."""
    why = tokenizer_difference(student, teacher)
    if why:
        raise ModelDirError(f"the teacher's tokenizer ({where_tokenizer(cfg.teacher.model)}, teacher.model.path) is not "
                            f"the actor's ({where_tokenizer(cfg.actor.model)}, actor.model.path): {why}; the teacher "
                            "scores the student's token ids, so both must share one tokenizer (cross-tokenizer "
                            "distillation is not supported): use a teacher of the student's family")
