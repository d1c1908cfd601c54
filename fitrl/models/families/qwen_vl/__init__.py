"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL family, all in this folder (docs/architecture.md, "Where
to add things"): how the models are built, sharded and fed (:mod:`.family`, with the released
multimodal rotary positions of :mod:`.mrope`), the vision towers' tensors and FLOPs
(:mod:`.tower`, for the memory plan and the FLOP counter) and the media processing of the data
path and the vLLM engine (:mod:`.media`). Its registration is its rows in
fitrl/core/model_types.py and the import line in fitrl/models/families/__init__.py.
"""

from fitrl.models.families.qwen_vl.family import QWEN_VL, QwenVLFamily, backbone, concat_multi_modal
from fitrl.models.families.qwen_vl.media import VisionSpec
from fitrl.models.families.qwen_vl.tower import VisionShape

__all__ = ["QWEN_VL", "QwenVLFamily", "VisionShape", "VisionSpec", "backbone", "concat_multi_modal"]
