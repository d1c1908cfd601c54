"""What a tiny model architecture is made of: the chat templates and ``ArchSpec`` (shared by
the text archs in :mod:`fitrl.models.tiny` and the vision-language ones in
:mod:`fitrl.models.tiny_vl`), and the decoder's rope and length settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fitrl.models.tiny_vl import TinyVisionArch

MAX_POSITION_EMBEDDINGS = 2048
ROPE_PARAMETERS = {"rope_type": "default", "rope_theta": 10000.0}

# Renders a message's content: a string, or a list of {"type": "text", "text": ...} parts.
_CONTENT = (
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}"
    "{%- endif %}"
)

_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{%- generation %}" + _CONTENT + "{{- '<|im_end|>' }}{%- endgeneration %}"
    "{%- else %}" + _CONTENT + "{{- '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
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
    vision: "TinyVisionArch | None" = None  # vision-language archs only (VL_ARCHS)


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
