"""What a run knows about each of its models, read once: :class:`ModelDescription` (one model
directory) and :class:`RunModels` (every model of a run, by config section).

``train()`` (fitrl/trainer/run.py) reads them after the Hub ids are resolved, before anything
else asks about a model: each ``config.json`` is parsed (and its shape keys checked) once, the
family picked from its ``model_type`` once, and the start-up checks, the memory plan, the data
path, the divergence judge, the FLOPs counter and every worker (through its group, pickled to a
Ray rank) read these values instead of the directory. A worker built without one (tests,
benchmarks) reads its own from the path: ``described`` in fitrl/models/loading.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Optional

from fitrl.models.check import read_model_config, run_models

if TYPE_CHECKING:
    from fitrl.config.schema import FitrlConfig, ModelConfig
    from fitrl.data.media import MediaSpec
    from fitrl.models.families.base import ModelFamily
    from fitrl.models.flops import FlopsShape
    from fitrl.models.shape import ModelShape


@dataclass(frozen=True)
class ModelDescription:
    """One model directory as read once: its paths, its parsed ``config.json`` and its family
    (by name: a family object is looked up in its registry, so the description pickles as plain
    data). What the start-up sites derive from the config (:attr:`media_spec`, :attr:`vocab_size`,
    :attr:`shape`) is computed on first use, in the process that asks, and never pickled."""

    path: str
    tokenizer_path: str
    """Where its tokenizer is: ``tokenizer_path`` of its config section, else :attr:`path`."""
    config: dict[str, Any] = field(repr=False)
    """The parsed ``config.json``, shape keys checked (fitrl/models/check.py, ``read_model_config``);
    shared, not to be changed."""
    family_name: str

    @classmethod
    def read(cls, model: "ModelConfig", what: str = "actor.model.path") -> "ModelDescription":
        """Read ``model``'s directory (``what``: the key of its path, for messages)."""
        return cls.of(model, read_model_config(model.path, what))

    @classmethod
    def of(cls, model: "ModelConfig", config: dict[str, Any]) -> "ModelDescription":
        """``model``'s description from its already parsed ``config``."""
        from fitrl.models.families import family_of_type  # (torch: only once the checks read the config)

        return cls(path=model.path, tokenizer_path=model.tokenizer_path or model.path, config=config,
                   family_name=family_of_type(str(config.get("model_type", ""))).name)

    @property
    def family(self) -> "ModelFamily":
        """How the model is built, sharded and fed (fitrl/models/families/)."""
        from fitrl.models.families import MODEL_FAMILIES

        return MODEL_FAMILIES.get(self.family_name)

    @cached_property
    def media_spec(self) -> "Optional[MediaSpec]":
        """How the data path feeds it images; None for a text model."""
        return self.family.media_spec(self.path)

    @cached_property
    def vocab_size(self) -> int:
        """Its output vocabulary: the text model's, for a vision-language one (as :class:`ModelShape` reads it)."""
        text = self.config.get("text_config")
        return int(text["vocab_size"] if isinstance(text, dict) and "vocab_size" in text else self.config["vocab_size"])

    @cached_property
    def shape(self) -> "ModelShape":
        """Its tensors, as the memory plan lists them (a ValueError for a type the planner does not model)."""
        from fitrl.models.shape import ModelShape

        return ModelShape.from_dict(self.config)

    def flops_shape(self) -> "tuple[Optional[FlopsShape], str]":
        """(its FLOPs shape, why there is none): as fitrl/trainer/perf.py's ``load_flops_shape``."""
        from fitrl.models.flops import FlopsShape

        try:
            return FlopsShape.from_config(self.config), ""
        except ValueError as e:
            return None, str(e)

    def __getstate__(self) -> dict[str, Any]:
        """The fields only: what was derived is derived again where it is asked for."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class RunModels:
    """Every model a run loads, by the config section that names it: ``actor.model``,
    ``ref.model`` and ``critic.model`` (the actor's own description when the section names no
    model of its own: those roles then load the actor's), ``teacher.model``, and
    ``reward.sources.NAME.model`` for each reward model and judge. A directory named by several
    sections is read once."""

    by_key: dict[str, ModelDescription]

    @classmethod
    def read(cls, cfg: "FitrlConfig") -> "RunModels":
        """The models ``cfg``'s run loads (fitrl/models/check.py, ``run_models``), each read once,
        in the order the start-up checks name them (the first unreadable one is the error)."""
        configs: dict[str, dict[str, Any]] = {}

        def describe(model: "ModelConfig", key: str) -> ModelDescription:
            if model.path not in configs:
                configs[model.path] = read_model_config(model.path, f"{key}.path")
            return ModelDescription.of(model, configs[model.path])

        by_key = {key: describe(model, key) for model, key, _ in run_models(cfg)}
        actor = by_key["actor.model"]
        for key, section in (("ref.model", cfg.ref), ("critic.model", cfg.critic)):
            if section.model is None:
                by_key.setdefault(key, actor)
        for name, src in cfg.reward.sources.items():
            if src.kind != "function":
                key = f"reward.sources.{name}.model"
                by_key[key] = describe(src.model, key)
        return cls(by_key)

    @property
    def actor(self) -> ModelDescription:
        return self.by_key["actor.model"]

    def get(self, key: str) -> Optional[ModelDescription]:
        """The description of the model config section ``key`` (``teacher.model``); None when the
        run loads no model there."""
        return self.by_key.get(key)

    def configs(self) -> dict[str, dict[str, Any]]:
        """Each section's parsed ``config.json``, for the start-up checks (fitrl/models/check.py)."""
        return {key: d.config for key, d in self.by_key.items()}

