"""What the Hugging Face engine costs (``rollout.engine=hf``, the default): its planner,
registered beside the engine (fitrl/memory/engines.py says what a planner answers).

The engine generates with the trained module in the trainer rank's own process, so it holds no
weights of its own and has no process or weight sync: only a generating phase's working memory
(:func:`_generation`, sized by the decode path: fitrl/rollout/decode.py's static cache or
``generate``'s growing one)."""

from __future__ import annotations

from fitrl.memory.engines import ENGINE_PLANNERS, EnginePlanner
from fitrl.memory.model import Usage
from fitrl.memory.passes import adapter_params, autocast_weights, bf16_widening, micro_images, traced_transient, vision_activations
from fitrl.memory.run import Run
from fitrl.memory.sharding import sharding_plan
from fitrl.memory.states import DTYPE_BYTES


@ENGINE_PLANNERS.register("hf")
class HFPlanner(EnginePlanner):
    name = "hf"
    plans_lora = True

    def in_trainer(self, run: Run, phase: str, usage: Usage, dev: str) -> None:
        # with rollout workers of their own the trainer ranks generate for validation only
        if phase == "validation" or (phase == "rollout" and not run.cfg.rollout.workers):
            _generation(run, phase, usage, dev)

    def in_worker(self, run: Run, phase: str, usage: Usage, dev: str) -> None:
        _generation(run, "rollout", usage, dev, seqs=max(1, run.batch.sequences_per_step // run.cfg.rollout.workers),
                    own_copy=True)

    def notes(self, run: Run) -> list[str]:
        if not run.cuda:
            return []
        sharding = sharding_plan(run.cfg.actor)  # (a sharded policy's weights are gathered for generate)
        gathered = f" (gathered once per call under {sharding.title})" if sharding.name != "plain" else ""
        return [f"rollout engine: transformers generate inside each trainer rank, on the actor's weights{gathered}"]


def _generation(run: Run, ph: str, u: Usage, dev: str, seqs: int | None = None, own_copy: bool = False) -> None:
    """A generate call's working memory in a trainer rank (or, ``own_copy``, a rollout worker's
    ``seqs`` sequences on its unsharded copy): the weights it runs on, the KV cache of a
    micro-batch of ``rollout.micro_batch_size`` sequences, its pixel values, the prefill's
    transients or the sampler's, whichever is larger, and the rollout batch."""
    cfg, shape = run.cfg, run.shape
    seqs = seqs or run.generated_seqs(ph)
    b = min(cfg.rollout.micro_batch_size, seqs)
    cb = DTYPE_BYTES[run.compute_dtype]
    # (a rollout worker's own copy: its weights are its states, fitrl/memory/roles.py, RolloutPlanner)
    if run.distributed and not own_copy:  # gathered_for_generation: the full weights for the whole call
        u.add(dev, "gathered weights", (shape.num_params + adapter_params(run)[1]) * cb)
    elif run.autocast and not own_copy:  # autocast's bf16 copies (the cached trained weights), for the whole generate call
        u.add(dev, "autocast weights", autocast_weights(run, grad=False))
        if not run.cuda:  # the prefill's projections over b x P tokens, the head over b rows
            u.add(dev, "bf16 widening", bf16_widening(run, b, b * run.prompt_len))
    # rollout.decode=loop's StaticCache (fitrl/rollout/decode.py) is sized at the call's prompt width +
    # max_tokens before the first token: its response part is at the cap whatever the responses hold.
    # generate (a vision-language model, or rollout.decode=generate) grows its cache with the longest
    # response of the call. Under autocast the keys leave the rotary in fp32, the values a bf16
    # projection (fitrl/rollout/decode.py, _values_in_their_own_dtype): 4 + 2 bytes a pair.
    static = cfg.rollout.decode == "loop" and shape.vision is None
    kv_tokens = run.prompt_len + (run.cap_response_len if static else run.response_len)
    per_token = ((shape.kv_bytes_per_token(4) + shape.kv_bytes_per_token(2)) // 2 if run.autocast
                 else shape.kv_bytes_per_token(cb))
    u.add(dev, "kv cache", b * kv_tokens * per_token)
    u.add(dev, "image buffers", micro_images(run, b))  # a generate call's pixel values, one row per sequence
    if run.cuda:
        u.add("host", "image buffers", micro_images(run, b))
    prefill = traced_transient(run, "prefill", b, run.prompt_len) - b * run.prompt_len * shape.kv_bytes_per_token(cb)
    prefill += vision_activations(run, b, grad=False, checkpointing=False)  # the prefill encodes the images
    # SampleAndRecord: the fp32 scores, the tempered copy, the pending log-softmax, top-k/top-p copies
    sampling = b * shape.vocab * 4 * (4 + 5 * (cfg.rollout.top_p < 1.0))
    u.add(dev, "activations", max(prefill, sampling))
    u.add("host", "batch", run.batch_bytes(seqs))
