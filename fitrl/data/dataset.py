"""Prompt datasets: read rows, build the text the policy sees, tokenise, filter by length.

Everything is read and tokenised eagerly at start-up. RL prompt sets are small (thousands to
a few hundred thousand rows), and doing it up front means a bad row fails the run in the first
seconds, with its file and line, instead of at step 3000; it also lets us report exactly how
many prompts the length limit dropped before any GPU time is spent.

Every problem with the data is a :class:`DataError` whose message starts with where it is:
``path:line`` for jsonl (1-based, counting blank lines) and ``path: row i`` (0-based, as in
``dataset[i]``) for json, parquet and ``save_to_disk`` directories.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from typing import Any, NamedTuple, Optional

import jinja2
import numpy as np

from fitrl.config.data import DataConfig
from fitrl.core.errors import DataError
from fitrl.data.batch import Batch
from fitrl.data.images import BadImage, load_image
from fitrl.data.rows import MISSING, iter_rows, kind_of, lookup, missing_key_text, rows_base_dir
from fitrl.data.media import MediaSpec, RowMedia
from fitrl.data.supervised import COMPLETION, MESSAGES, chat_target, conversation, conversation_format


# --------------------------------------------------------------------------------------------
# Building prompts


class _Row(NamedTuple):
    """A data row read and templated, before tokenisation."""
    source: str
    row: dict
    text: str
    """The prompt as people read it (each image's run of pad tokens written once)."""
    id_text: str
    """The text the ids encode (every image token)."""
    media: Optional[RowMedia]
    messages: list
    """The prompt as chat messages before any template, text only (what a reward model or a
    judge renders through its own chat template: fitrl/roles/model_reward.py)."""


class PromptDataset:
    """All prompts of ``files``, tokenised, with prompts over ``max_prompt_length`` tokens dropped.

    ``ds[i]`` is a dict with ``prompt_ids`` (list[int]), ``prompt_text`` (exactly the text the
    ids encode), ``answer`` (passed to the reward), ``extra`` (the row's other columns),
    ``source`` (``file:line`` / ``file: row i``) and ``index`` (``i``).

    With ``vision`` (a vision-language policy's media spec, :class:`fitrl.data.media.MediaSpec`;
    docs/vision.md) each row's images and videos (``media``: the ``data.*`` image and video
    keys) are checked and decoded once here and kept
    as references only: ``ds[i]`` also has ``images`` (resolved path or bytes per image),
    ``image_sizes`` (resized ``(h, w)``), ``videos`` (per video, its sampled frames) and
    ``video_sizes`` (``(frames, h, w)``); ``prompt_ids`` hold every image token, while
    ``prompt_text`` writes each image's run of ``<|image_pad|>`` once (for people to read).
    :meth:`multi_modal_inputs` makes the pixels of a row when a batch needs them.
    """

    def __init__(
        self,
        files: list[str],
        tokenizer: Any,
        *,
        prompt_key: str,
        answer_key: str,
        prompt_template: Optional[str] = None,
        system_prompt: Optional[str] = None,
        apply_chat_template: bool = True,
        max_prompt_length: int,
        name: str = "train",
        vision: Optional[MediaSpec] = None,
        media: Optional[DataConfig] = None,
        max_rows: Optional[int] = None,
        tools: Optional[list[dict]] = None,
    ) -> None:
        """``max_rows``: read only the first this many rows of each file (the memory planner's
        sample of prompt lengths, fitrl/memory/lengths.py); unset: every row. ``tools``: the JSON
        schemas of a multi-turn run's tools (``rollout.agent.tools``), rendered into every prompt
        by the chat template, as the model sees them (and as the length filter must count them).

        Built in four steps: the options checked (:meth:`_template`), each row templated and its
        media read (:meth:`_read_rows`), every prompt tokenised in one call (:meth:`_tokenize`),
        and the prompts over ``max_prompt_length`` dropped (:meth:`_examples_within`)."""
        if isinstance(files, (str, os.PathLike)):
            files = [files]
        self.files = [str(f) for f in files]
        self.name = name
        self.max_prompt_length = max_prompt_length
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.system_prompt, self.apply_chat_template = system_prompt, apply_chat_template
        self.vision = vision
        self.tools = tools or None
        self.media = media if media is not None else DataConfig()
        self.bad_image_counts: Counter[str] = Counter()  # rows skipped (data.on_bad_image=skip), by reason
        template = self._template(tokenizer, prompt_template)
        rows = self._read_rows(tokenizer, template, max_rows)
        ids = self._tokenize(tokenizer, rows)
        self.num_rows = len(rows) + self.num_bad_image_rows
        self._examples = self._examples_within(rows, ids)
        self.num_filtered = len(rows) - len(self._examples)

    def _template(self, tokenizer: Any, prompt_template: Optional[str]) -> Optional[jinja2.Template]:
        """The options checked against each other and the tokenizer; the compiled prompt template."""
        if not self.files:
            raise DataError(f"{self.name}: no data files given")
        if self.max_prompt_length < 1:
            raise DataError(f"data.max_prompt_length must be >= 1, got {self.max_prompt_length}")
        if self.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "the tokenizer has no chat template; set data.apply_chat_template=false "
                "(and shape the prompt with data.prompt_template) or use a tokenizer that has one"
            )
        if self.system_prompt is not None and not self.apply_chat_template:
            # Without a chat template there is no "system message"; gluing it on in some made-up
            # format would be guessing, and prompt_template already expresses any prefix exactly.
            raise DataError(
                "data.system_prompt needs data.apply_chat_template=true; "
                "for a plain-text prefix put it in data.prompt_template instead"
            )
        if self.vision is not None:
            self.vision.check_tokenizer(tokenizer)
        if prompt_template is None:
            return None
        # StrictUndefined: a misspelt column must fail loudly, not render as an empty string.
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        try:
            return env.from_string(prompt_template)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(f"data.prompt_template: syntax error at line {e.lineno}: {e.message}") from None

    def _read_rows(self, tokenizer: Any, template: Optional[jinja2.Template], max_rows: Optional[int]) -> list[_Row]:
        """Every row of the files as the text its prompt is (chat template applied) and, with
        vision, its media read and checked; bad-image rows skipped or refused (``data.on_bad_image``)."""
        rows = []
        for path in self.files:
            # Relative image paths: data.image_dir, else the directory of the file (or saved dataset).
            base_dir = self.media.image_dir or rows_base_dir(path)
            for source, row in itertools.islice(iter_rows(path), max_rows):
                try:
                    rows.append(self._read_row(tokenizer, template, source, row, base_dir))
                except BadImage as e:
                    self._bad_row(source, e)
        self.num_bad_image_rows = sum(self.bad_image_counts.values())
        if not rows and self.num_bad_image_rows:
            raise DataError(f"{self.name}: every row of {', '.join(self.files)} has a bad image and was skipped "
                            f"({self._bad_image_text()}); fix the images or set data.on_bad_image=error to see "
                            f"the first one")
        if not rows:
            raise DataError(f"{self.name}: no rows in {', '.join(self.files)}")
        return rows

    def _read_row(self, tokenizer: Any, template: Optional[jinja2.Template], source: str, row: dict,
                  base_dir: str) -> _Row:
        """One row's prompt text (and media); :class:`BadImage` for a row whose media are bad."""
        fmt = conversation_format(row, self.prompt_key, self.answer_key)
        if fmt is not None:  # TRL's conversational rows: `fitrl sft` targets (fitrl/data/supervised.py)
            return self._read_conversation(tokenizer, source, row, fmt)
        # With a template the prompt column is optional: the template names what it uses.
        # No answer_key (""): the rows have no answer column (fitrl.train with rewards that read none).
        required = (([] if template else [(self.prompt_key, "prompt_key")])
                    + ([(self.answer_key, "answer_key")] if self.answer_key else []))
        for key, option in required:
            if lookup(row, key) is MISSING:
                raise DataError(f"{source}: row has no {key!r} column ({missing_key_text(row, key)}); set data.{option}")
        messages = self._messages(source, row, self.prompt_key, template, self.system_prompt)
        media_of_row = None
        if self.vision is None:
            self._refuse_media(source, row)
        else:
            messages, media_of_row = self.vision.read_row_media(source, row, messages, opts=self.media,
                                                                base_dir=base_dir)
        if self.apply_chat_template:
            text = tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=True, tokenize=False)
        elif len(messages) == 1 and messages[0]["role"] == "user":
            text = messages[0]["content"]
        else:
            raise DataError(f"{source}: a multi-message conversation needs data.apply_chat_template=true")
        id_text = text
        if media_of_row is not None:  # one <|image_pad|> per image token: the ids (and the length filter) count them
            id_text = self.vision.expand_placeholders(text, media_of_row.image_tokens, media_of_row.video_tokens)
        return _Row(source, row, text, id_text, media_of_row, _text_messages(messages))

    def _read_conversation(self, tokenizer: Any, source: str, row: dict, fmt: str) -> _Row:
        """A row in one of TRL's conversational formats (``messages``, ``prompt``/``completion``):
        the prompt is the conversation before the turns the loss covers, through the chat
        template; the answer is the rest, rendered and masked (a ``ChatTarget``)."""
        if not self.apply_chat_template:
            raise DataError(f"{source}: a {fmt!r} row is a conversation and needs data.apply_chat_template=true")
        if self.vision is not None:
            raise DataError(f"{source}: {fmt!r} rows are read for text models only; use prompt/answer rows "
                            f"for a vision-language model")
        self._refuse_media(source, row)
        messages, start = conversation(source, row, fmt, self.prompt_key)
        if self.system_prompt is not None:
            if messages[0]["role"] == "system":
                raise DataError(f"{source}: the conversation already has a system message; unset data.system_prompt")
            messages, start = [{"role": "system", "content": self.system_prompt}] + messages, start + 1
        text, target = chat_target(tokenizer, messages, start, source, self.tools)
        columns = {k: v for k, v in row.items() if k not in (MESSAGES, COMPLETION, self.prompt_key)}
        return _Row(source, {**columns, self.answer_key: target}, text, text, None, _text_messages(messages[:start]))

    def _tokenize(self, tokenizer: Any, rows: list[_Row]) -> list[list[int]]:
        """Every prompt's ids, in one batched call: fast tokenizers parallelise it, which matters
        for 100k-row sets. The chat template already writes its own BOS/special tokens, so adding
        the tokenizer's defaults again would double them; plain text gets the defaults as a base
        model expects."""
        return tokenizer([r.id_text for r in rows], add_special_tokens=not self.apply_chat_template)["input_ids"]

    def _examples_within(self, rows: list[_Row], ids: list[list[int]]) -> list[dict]:
        """The examples whose prompts fit ``max_prompt_length`` tokens (``ds[i]``'s dicts)."""
        examples: list[dict] = []
        # With vision, the media columns travel as references in the example, not in `extra`
        # (which is shipped to the reward with every sample).
        own = (self.prompt_key, self.answer_key) + ((self.media.image_key, self.media.video_key) if self.vision else ())
        for r, prompt_ids in zip(rows, ids):
            if len(prompt_ids) > self.max_prompt_length:
                continue
            extra = {k: v for k, v in r.row.items() if k not in own}
            ex = dict(prompt_ids=list(prompt_ids), prompt_text=r.text, prompt_messages=r.messages,
                      answer=lookup(r.row, self.answer_key) if self.answer_key else None,
                      extra=extra, source=r.source, index=len(examples))
            m = r.media
            if m is not None:
                ex.update(images=m.images, image_sizes=m.image_sizes, videos=m.videos, video_sizes=m.video_sizes)
            examples.append(ex)
        if not examples:
            lengths = [len(x) for x in ids]
            raise DataError(
                f"{self.name}: all {self.num_rows} rows of {', '.join(self.files)} are longer than "
                f"data.max_prompt_length={self.max_prompt_length} tokens (shortest {min(lengths)}, longest "
                f"{max(lengths)}); raise data.max_prompt_length"
            )
        return examples

    @classmethod
    def from_config(cls, files: list[str], tokenizer: Any, d: DataConfig, *, name: str,
                    vision: Optional[MediaSpec], max_rows: Optional[int] = None,
                    tools: Optional[list[dict]] = None) -> "PromptDataset":
        """The prompts of ``files`` built as the run builds them from ``data.*`` (the trainer's
        datasets, and the planner's sample of prompt lengths: both must see the same prompts)."""
        return cls(files, tokenizer, name=name, prompt_key=d.prompt_key, answer_key=d.answer_key,
                   prompt_template=d.prompt_template, system_prompt=d.system_prompt,
                   apply_chat_template=d.apply_chat_template, max_prompt_length=d.max_prompt_length,
                   vision=vision, media=d, max_rows=max_rows, tools=tools)

    @staticmethod
    def _messages(source: str, row: dict, prompt_key: str, template: Optional[jinja2.Template],
                  system_prompt: Optional[str]) -> list[dict]:
        """The conversation for one row: system prompt (if any) then the user message(s)."""
        if template is not None:
            try:
                prompt: Any = template.render(**row)
            except jinja2.UndefinedError as e:
                raise DataError(
                    f"{source}: data.prompt_template uses an undefined variable: {e.message} "
                    f"(columns: {', '.join(map(str, row))})"
                ) from None
        else:
            prompt = lookup(row, prompt_key)
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and prompt:
            for m in prompt:
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise DataError(f"{source}: {prompt_key!r} is a list but not of {{'role': str, 'content': str}} messages: {m!r}")
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        else:
            raise DataError(
                f"{source}: {prompt_key!r} is {kind_of(prompt) if prompt != [] else 'an empty list'}; "
                f"expected a string or a list of {{'role', 'content'}} messages"
            )
        if system_prompt is not None:
            if messages[0]["role"] == "system":
                # Two system messages break most chat templates; make the user choose.
                raise DataError(f"{source}: the conversation already has a system message; unset data.system_prompt")
            messages.insert(0, {"role": "system", "content": system_prompt})
        return messages

    def _refuse_media(self, source: str, row: dict) -> None:
        """A text policy cannot see images: a row that has some is not silently read as text."""
        for key, noun in ((self.media.image_key, "images"), (self.media.video_key, "videos")):
            if row.get(key) not in (None, [], "", b""):
                raise DataError(f"{source}: row has {noun} (column {key!r}) but actor.model.path is a text model; "
                                f"use a vision-language model or drop the {key!r} column")

    def _bad_row(self, source: str, e: Exception) -> None:
        """``data.on_bad_image``: stop naming the row and image, or count the row as skipped."""
        if self.media.on_bad_image == "error":
            raise DataError(f"{source}: {e}; fix or remove the row, or set data.on_bad_image=skip") from None
        self.bad_image_counts[getattr(e, "kind", "bad image")] += 1

    def _bad_image_text(self) -> str:
        return ", ".join(f"{n} {kind}" for kind, n in self.bad_image_counts.most_common())

    @property
    def has_vision(self) -> bool:
        """The prompts are for a vision-language policy (batches carry ``multi_modal_inputs``)."""
        return self.vision is not None

    def multi_modal_inputs(self, i: int) -> Optional[dict]:
        """The model inputs of ``ds[i]``'s images and videos, decoded now; ``None`` without any.

        Keys (tensors on CPU): ``pixel_values`` (float32, ``(patches, C*tp*p*p)``) and
        ``image_grid_thw`` (int64, ``(images, 3)``) when the row has images;
        ``pixel_values_videos``, ``video_grid_thw`` and, for Qwen2.5-VL, ``second_per_grid_ts``
        (float32, ``(videos,)``) when it has videos (the family's media spec, :mod:`fitrl.data.media`).
        """
        ex = self._examples[i]
        if not ex.get("images") and not ex.get("videos"):
            return None
        m = self.media
        try:
            images = [load_image(r, max_side=m.max_image_side) for r in ex["images"]]
            videos = [[load_image(r, max_side=m.max_image_side) for r in frames] for frames in ex["videos"]]
        except BadImage as e:
            raise DataError(f"{ex['source']}: an image of this row cannot be read any more ({e}); "
                            f"it changed since start-up") from None
        media = RowMedia(image_sizes=ex.get("image_sizes", []), video_sizes=ex.get("video_sizes", []))
        return self.vision.model_inputs(images, videos, media, m, ex["source"])

    def __len__(self) -> int:
        return len(self._examples)

    def __getitem__(self, i: int) -> dict:
        ex = self._examples[i]
        # A copy, so a caller that edits its batch cannot corrupt the dataset for later epochs.
        return {**ex, "prompt_ids": list(ex["prompt_ids"]), "extra": dict(ex["extra"])}

    def batch(self, indices: list[int], tag: str) -> Batch:
        """The rows ``indices`` as a prompts batch for the rollout: token ids, answers, the text
        people read in the generation samples, source and extra fields, one ``uid`` per row
        (``{tag}-{j}``: the n samples of a prompt form one group) and, for a vision-language
        policy, each prompt's model inputs (pixel values, grids) or None."""
        rows = [self[i] for i in indices]
        return Batch(fields={
            "prompt_ids": [r["prompt_ids"] for r in rows],
            "answer": [r["answer"] for r in rows],
            "prompt_text": [r["prompt_text"] for r in rows],
            "prompt_messages": [r["prompt_messages"] for r in rows],
            "source": [r["source"] for r in rows],
            "extra": [r["extra"] for r in rows],
            "uid": [f"{tag}-{j}" for j in range(len(rows))],
            **({"multi_modal_inputs": [self.multi_modal_inputs(i) for i in indices]} if self.has_vision else {}),
        })

    def summary(self) -> str:
        """One line for the start-up log, e.g. ``train: 80 prompts from 1 file (3 longer than 256
        tokens dropped); prompt tokens min/mean/max 12/14.2/19``."""
        lengths = [len(ex["prompt_ids"]) for ex in self._examples]
        n_files = len(self.files)
        dropped = (f" ({self.num_filtered} longer than {self.max_prompt_length} tokens dropped)"
                   if self.num_filtered else "")
        if self.num_bad_image_rows:
            dropped += f" ({self.num_bad_image_rows} rows with bad images skipped: {self._bad_image_text()})"
        images = ""
        if self.has_vision:
            per_row = [len(ex["images"]) + len(ex["videos"]) for ex in self._examples]
            images = f"; {sum(per_row)} images/videos in {sum(1 for n in per_row if n)} prompts"
        return (f"{self.name}: {len(self)} prompts from {n_files} file{'s' if n_files != 1 else ''}{dropped}; "
                f"prompt tokens min/mean/max {min(lengths)}/{sum(lengths) / len(lengths):.1f}/{max(lengths)}{images}")


# --------------------------------------------------------------------------------------------
# Sampling


class PromptSampler:
    """Endless stream of dataset indices in batches, one fresh permutation per epoch.

    The order is a pure function of ``(seed, epoch, cursor)``, so ``state_dict()`` is just those
    numbers and a restored sampler continues with exactly the batches the original would have drawn.
    A batch may straddle an epoch boundary, so every step gets ``batch_size`` prompts and no prompt
    is skipped; ``batch_size > size`` simply wraps through several epochs.
    """

    def __init__(self, size: int, batch_size: int, shuffle: bool, seed: int) -> None:
        if size < 1:
            raise ValueError(f"PromptSampler needs at least one prompt, got size={size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        self._epoch = 0
        self._cursor = 0  # position in the current epoch's order; always < size
        self._order: Optional[np.ndarray] = None

    @property
    def epoch(self) -> int:
        """The epoch the next index comes from (= completed passes over the data)."""
        return self._epoch

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            if self.shuffle:
                # Seed with the pair (seed, epoch), not seed + epoch: otherwise seed 1 epoch 1 and
                # seed 2 epoch 0 would share an order, correlating runs that should be independent.
                self._order = np.random.default_rng([self.seed, self._epoch]).permutation(self.size)
            else:
                self._order = np.arange(self.size)
        return self._order

    def next_indices(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.batch_size:
            take = min(self.batch_size - len(out), self.size - self._cursor)
            out.extend(int(i) for i in self._epoch_order()[self._cursor:self._cursor + take])
            self._cursor += take
            if self._cursor == self.size:
                self._epoch, self._cursor, self._order = self._epoch + 1, 0, None
        return out

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "cursor": self._cursor, "size": self.size,
                "shuffle": self.shuffle, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        # The saved position only means something for the same data and order; refuse otherwise
        # rather than silently resuming into a different sequence.
        for key in ("size", "shuffle", "seed"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"sampler state was saved with {key}={state[key]!r} but this run has {key}={getattr(self, key)!r}; "
                    f"resume with the same data and trainer.seed"
                )
        if not 0 <= state["cursor"] < self.size or state["epoch"] < 0:
            raise ValueError(f"invalid sampler state {state}")
        self._epoch, self._cursor, self._order = int(state["epoch"]), int(state["cursor"]), None


def _text_messages(messages: list[dict]) -> list[dict]:
    """Messages with text content only: a multimodal content list keeps its text parts."""
    def text(content) -> str:
        if isinstance(content, str):
            return content
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return [{"role": m["role"], "content": text(m["content"])} for m in messages]
