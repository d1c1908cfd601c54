"""What a tiny model architecture is made of: the chat templates and ``ArchSpec`` (shared by
the text archs in :mod:`fitrl.models.tiny` and the vision-language ones in
:mod:`fitrl.models.tiny_vl`, whose vision side, ``TinyVisionArch``, is here too so that this
module imports neither), and the decoder's rope and length settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

MAX_POSITION_EMBEDDINGS = 2048
ROPE_PARAMETERS = {"rope_type": "default", "rope_theta": 10000.0}

# Renders a message's content: a string, or a list of {"type": "text", "text": ...} parts.
_CONTENT = (
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}"
    "{%- endif %}"
)

# Tools (``apply_chat_template(..., tools=[...])``) as Qwen2.5 renders them, its instructions
# shortened (a random tiny model cannot read them; each token of a constant prefix costs compute
# and dilutes attention, docs/agents.md): their JSON schemas in the system turn, the model's calls as <tool_call> JSON, each tool reply a <tool_response> in a
# user turn (consecutive replies in one). Without tools and tool messages the text is what it
# was before tools existed, byte for byte.
_TOOLS_SYSTEM = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one as <tool_call>{\\\"name\\\": ..., \\\"arguments\\\": {...}}</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
)
_TOOL_CALLS = (
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\\\"name\\\": \\\"' + call['function']['name'] + '\\\", \\\"arguments\\\": ' "
    "+ (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
)

_CHATML_TEMPLATE = (
    _TOOLS_SYSTEM +
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}" + _CONTENT + "{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{%- generation %}" + _CONTENT + _TOOL_CALLS +
    "{{- '<|im_end|>' }}{%- endgeneration %}"
    "{%- else %}" + _CONTENT + "{{- '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}{%- generation %}" + _CONTENT + "{{- '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}" + _CONTENT + "{{- '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyVisionArch:
    """How a tiny vision-language arch is built (its processor, tower config, multimodal rope); the
    vision side of a real model directory, as the data path reads it, is the family's
    ``VisionSpec`` (fitrl/models/families/qwen_vl/media.py)."""

    processor_class: str  # the transformers processor AutoProcessor builds for this model_type
    video_processor: str  # its video processor class (torchvision only, in transformers 5.23)
    patch_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    size_keys: str  # how the real preprocessor_config.json states the pixel budget: "pixels" (min/max_pixels) or "size"
    vision_config: Callable[[dict[str, Any], int, int], dict[str, Any]]  # (VISION_SIZES row, text hidden, layers)
    mrope_section: Callable[[int], list[int]]  # head_dim // 2 -> (t, h, w) rotary frequencies, summing to it
    rope_extra: dict[str, Any] = field(default_factory=dict)  # more rope_parameters keys
    states_head_dim: bool = False  # the text config has a head_dim key (Qwen3-VL's defaults to 128: set it)


@dataclass(frozen=True)
class ArchSpec:
    config_class: str  # name in ``transformers``
    model_class: str
    special_tokens: tuple[str, ...]  # appended after the BPE vocabulary, in this order
    bos: str | None  # None: the model has no BOS
    eos: str  # end of an assistant turn; generation stops here
    pad: str
    chat_template: str
    add_bos: bool  # whether plain ``tokenizer(text)`` prepends the BOS
    pretokenizer: str  # "qwen2": Qwen2's own split regex; "digits": Digits(individual) + ByteLevel regex
    tokenizer_class: str  # written to tokenizer_config.json: the class AutoTokenizer really loads
    vision: TinyVisionArch | None = None  # vision-language archs only (VL_ARCHS)


ARCHS: dict[str, ArchSpec] = {
    "qwen2": ArchSpec(
        config_class="Qwen2Config",
        model_class="Qwen2ForCausalLM",
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        chat_template=_CHATML_TEMPLATE,
        add_bos=False,
        pretokenizer="qwen2",
        tokenizer_class="Qwen2Tokenizer",
    ),
    "llama": ArchSpec(
        config_class="LlamaConfig",
        model_class="LlamaForCausalLM",
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|finetune_right_pad_id|>",
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
        chat_template=_LLAMA3_TEMPLATE,
        add_bos=True,
        pretokenizer="digits",
        tokenizer_class="PreTrainedTokenizerFast",
    ),
}
