"""Model shapes from a Hugging Face ``config.json``: every parameter tensor in closed form.

The planner never loads weights: a bare ``config.json`` is enough. ``ModelShape.tensors()``
lists each parameter's name and shape as the transformers modules create them, so per-rank shard
sizes (FSDP2 pads dim 0 to a multiple of the world size) and pinned-memory rounding can be
computed tensor by tensor. ``tests/test_plan_states.py`` checks the totals against real models,
tensor for tensor.

The text decoder is described by its family too (:class:`~fitrl.models.decoder.Decoder`, from
``ModelFamily.decoder_layout``; the text families' layouts are in
fitrl/models/families/causal_lm.py): its layers' tensors, its KV cache per token, its FLOPs per
token, and whether it is dense or a mixture of experts. This module reads no family's name.

A vision-language model's tower is described by its family (:class:`~fitrl.models.vision.VisionTower`, from
``ModelFamily.vision_tower``; the Qwen-VL towers are in fitrl/models/families/qwen_vl/tower.py),
so adding a family touches its own folder, not this module. Images go through the processor's
geometry (``VisionTower.largest_image``): each side resized to a multiple of ``patch * merge``
pixels within the pixel budget, cut into patches of ``temporal_patch x patch x patch`` pixels,
``merge x merge`` patches per language-model token (:class:`~fitrl.models.vision.VisualInput`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from fitrl.core.model_types import MODEL_TYPES, ModelType, decoder_family
from fitrl.models.config_json import read_config_json
from fitrl.models.decoder import PLAIN_DENSE, Decoder, experts_in
from fitrl.models.vision import VisionTower


@dataclass(frozen=True)
class ModelShape:
    """A model's parameters as the memory plan lists them: the embedding and the head (``vocab``,
    ``tied``), the text decoder its family describes (:class:`~fitrl.models.decoder.Decoder`,
    from ``ModelFamily.decoder_layout``) and, for a vision-language model, its vision tower."""
    model_type: str
    vocab: int
    tied: bool
    decoder: Decoder
    vision: Optional[VisionTower] = None
    raw: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_path(cls, path: str | Path, strict: bool = True) -> "ModelShape":
        """From a model directory (only its ``config.json`` is read) or a ``config.json`` file."""
        return cls.from_dict(cls.read_config(path), strict=strict)

    @staticmethod
    def read_config(path: str | Path) -> dict[str, Any]:
        """The ``config.json`` of a model directory (or that file itself), as a dict
        (:func:`fitrl.models.config_json.read_config_json`: a ModelDirError when it cannot be read)."""
        return read_config_json(path, what="model directory")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], strict: bool = True) -> "ModelShape":
        """``strict``: a model type outside fitrl/core/model_types.py is a ValueError (the memory
        plan lists each tensor: it must know the family); otherwise it is read as a plain dense
        decoder (its text config's dimensions, no vision tower), as far as the FLOPs need. A row
        whose family describes no decoder of the row's kind, or a config that routes experts under
        a dense layout, is a ValueError either way: never planned as something else."""
        from fitrl.models.families import family_of_type  # the families import this module

        mt = cfg.get("model_type", "")
        row = MODEL_TYPES.get(mt)
        if row is None and strict:
            raise ValueError(f"model_type {mt!r} is not modelled by the planner; known: {', '.join(MODEL_TYPES)}")
        vl = row is not None and row.vision
        text = cfg.get("text_config") or cfg if vl or row is None else cfg
        family = family_of_type(mt)
        decoder = cls._decoder(mt, row, family, text)
        vision = None
        if vl:
            vision = family.vision_tower(cfg)
            if vision is None:
                raise ValueError(f"model_type {mt!r} is a vision-language model whose family describes no vision "
                                 f"tower (ModelFamily.vision_tower)")
        return cls(
            model_type=mt, vocab=text.get("vocab_size", cfg.get("vocab_size")),
            tied=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            decoder=decoder, vision=vision, raw=cfg,
        )

    @staticmethod
    def _decoder(mt: str, row: Optional[ModelType], family: Any, text: dict[str, Any]) -> Decoder:
        """``family``'s decoder of ``text``; a plain dense one for a type outside the table."""
        if row is None:
            layout = PLAIN_DENSE
        else:
            layout = family.decoder_layout(mt)
            if layout is None or layout.kind != row.kind:
                described = "no decoder" if layout is None else f"a {layout.kind} decoder"
                raise ValueError(f"model_type {mt!r} has a {row.kind} decoder (fitrl/core/model_types.py) and its "
                                 f"family {family.name!r} describes {described} (ModelFamily.decoder_layout): neither "
                                 f"the memory plan nor the FLOP counter can describe it")
        moe = experts_in(text)
        if moe is not None and layout.kind != "moe":
            raise ValueError(f"model_type {mt!r}: config.json describes a mixture of experts ({moe[0]}={moe[1]}), "
                             f"not the {layout.kind} decoder its family describes: neither the memory plan nor the "
                             f"FLOP counter can describe it")
        return layout.read(text)

    # ------------------------------------------------------------------ the decoder's dimensions
    # (read by the memory plan's activation and KV formulas; a decoder kind keeps their meaning)
    hidden = property(lambda self: self.decoder.hidden)
    layers = property(lambda self: self.decoder.layers)
    heads = property(lambda self: self.decoder.heads)
    kv_heads = property(lambda self: self.decoder.kv_heads)
    head_dim = property(lambda self: self.decoder.head_dim)
    intermediate = property(lambda self: self.decoder.intermediate)

    # ------------------------------------------------------------------ tensors
    def layer_tensors(self, i: int) -> list[tuple[str, tuple[int, ...]]]:
        return self.decoder.layer_tensors(i)

    def tensors(self, with_vision: bool = True) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter (tied embeddings counted once, as ``model.parameters()`` does)."""
        out = [("model.embed_tokens.weight", (self.vocab, self.hidden))]
        for i in range(self.layers):
            out += self.layer_tensors(i)
        out.append(("model.norm.weight", (self.hidden,)))
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, self.hidden)))
        if with_vision and self.vision is not None:
            out += self.vision.tensors()
        return out

    def linear_layers(self, with_vision: bool = True) -> list[tuple[str, int, int]]:
        """Every ``nn.Linear`` but the output head: (module name, in_features, out_features). The
        2-D weights of :meth:`tensors` are exactly these, plus the embedding and ``lm_head`` (a MoE
        router's bare weight is one too: PEFT adapts it as a linear layer)."""
        skip = ("model.embed_tokens.weight", "lm_head.weight")
        return [(n[:-len(".weight")], s[1], s[0]) for n, s in self.tensors(with_vision)
                if len(s) == 2 and n.endswith(".weight") and n not in skip]

    def lora_tensors(self, rank: int, targets: tuple[str, ...] | list[str]) -> list[tuple[str, tuple[int, int]]]:
        """LoRA adapters as PEFT's ``inject_adapter_in_model`` adds them (fitrl/models/params.py):
        ``lora_A`` (r, in) and ``lora_B`` (out, r) on every targeted linear layer, r*(in + out)
        parameters each. ``targets``: ``["all-linear"]`` (every linear but ``lm_head``) or module
        names, matched as PEFT does (the whole name, or its last dotted components). Then the
        decoder's adapters on other parameters (a mixture of experts' stacked experts:
        ``Decoder.parameter_adapters``), less the linear layers PEFT leaves out (``Decoder.adapts``)."""
        if rank <= 0:
            return []
        every = list(targets) == ["all-linear"]
        out = []
        for name, fan_in, fan_out in self.linear_layers():
            if (every or any(name == t or name.endswith("." + t) for t in targets)) and self.decoder.adapts(name):
                out += [(f"{name}.lora_A.default.weight", (rank, fan_in)),
                        (f"{name}.lora_B.default.weight", (fan_out, rank))]
        for i in range(self.layers):
            out += self.decoder.parameter_adapters(i, rank, list(targets))
        return out

    @property
    def num_params(self) -> int:
        return sum(_numel(s) for _, s in self.tensors())

    @property
    def layer_params(self) -> int:
        """The largest decoder layer's parameters (what FSDP2 gathers for one unit; a mixture of
        experts' dense layers are smaller than its sparse ones)."""
        return max(self._layer_sizes())

    @property
    def decoder_params(self) -> int:
        """Every decoder layer's parameters (the rest of :attr:`num_params` is the root unit's)."""
        return sum(self._layer_sizes())

    def _layer_sizes(self) -> list[int]:
        return [sum(_numel(s) for _, s in self.layer_tensors(i)) for i in range(self.layers)]

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token (the decoder's KV layout)."""
        return self.decoder.kv_bytes_per_token(dtype_bytes)

    def text_config(self, layers: Optional[int] = None) -> dict[str, Any]:
        """A plain decoder config of the same text shape (for tracing; ``layers`` overrides the depth)."""
        return dict(model_type=decoder_family(self.model_type), **self.decoder.config(layers or self.layers),
                    vocab_size=self.vocab, tie_word_embeddings=self.tied,
                    max_position_embeddings=max(32768, self.raw.get("max_position_embeddings", 0)))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def numel(shape: tuple[int, ...]) -> int:
    return _numel(shape)
