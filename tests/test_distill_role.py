"""On-policy distillation's teacher as a planned role (issue 64): its log-probs and top-k through
fitrl against a direct fp32 forward, the student's top-k pass against full logits, a short run
with a teacher (its metrics, phase and plan), resume, the roles built against the roles planned,
bad inputs (one line, exit 2, nothing written) and 2 FSDP2 ranks against one process.

The teacher and the student are two tiny models with the same tokenizer (``make_tiny_model``'s is
a function of the architecture and size) and other weights; a mismatched teacher is the ``agent``
size, whose tokenizer is trained on another corpus.
"""

from __future__ import annotations

import pytest
import torch
from badcases import run_case, Case
from bad_input_faults import no_new_run_dir, on_new
from helpers import read_metrics, tiny_rollout, toy_config
from test_run_layout import built_groups, check_built_is_planned  # noqa: F401  (a fixture, and its check)

from fitrl.core.padding import trim_padding
from fitrl.ops.logprob import choose_layout, response_logprobs
from fitrl.core.packing import PackedLayout
from fitrl.ops.shared_prompt import PromptGroups

SMALL = ["data.rollout_batch_size=4", "rollout.n=4", "actor.mini_batch_size=2", "actor.micro_batch_size=8",
         "trainer.val_before_train=false", "reward.num_workers=0", "trainer.num_threads=1"]
VOLATILE = ("time/", "mem/", "val/time", "perf/")  # wall-clock and memory readings differ run to run
LAYOUTS = {"padded": ["actor.packing=false", "actor.share_prompts=false"],
           "packed": ["actor.packing=true", "actor.share_prompts=false"],
           "shared": ["actor.packing=false", "actor.share_prompts=true"]}
LAYOUT_TYPES = {"padded": type(None), "packed": PackedLayout, "shared": PromptGroups}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher larger than the student (3 layers of width 96 against 2 of 64) with the student's
    tokenizer: the tiny model's directory, its weights replaced by a wider, deeper model's."""
    import transformers

    from fitrl.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("teacher") / "teacher", arch="qwen2", size="tiny", seed=1)
    config = transformers.AutoConfig.from_pretrained(path)
    config.update(dict(hidden_size=96, num_hidden_layers=3, intermediate_size=384, head_dim=24,
                       layer_types=["full_attention"] * 3))
    torch.manual_seed(1)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    """The student's rollout: 8 sequences, 4 prompts of 2 samples each (rows 2i, 2i + 1), the
    shortest prompt's two responses cut after their first token, so that those two sequences
    pack into one row of the longest's width (a packed forward then runs fewer positions)."""
    model, batch = tiny_rollout(tiny_model_dir)
    R = batch["responses"].shape[1]
    shortest = int(batch["attention_mask"][:, :-R].sum(-1).argmin()) // 2 * 2
    for row in (shortest, shortest + 1):
        batch["responses"][row, 1:] = batch.meta["pad_id"]
        batch["input_ids"][row, -R + 1:] = batch.meta["pad_id"]
        batch["response_mask"][row, 1:] = 0
        batch["attention_mask"][row, -R + 1:] = 0
    return model, batch


def distill(teacher, *extra):
    return ["algorithm.distill.weight=0.5", f"teacher.model.path={teacher}", *extra]


def comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def layout_of(model, batch, name):
    ids, mask, pos, R = trim_padding(batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                     batch["responses"].shape[1])
    return choose_layout(model, ids, mask, pos, R, None, share_prompts=name == "shared", pack=name == "packed")


# ------------------------------------------------------------------------------ the teacher's pass


@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_teacher_logprobs_equal_a_direct_fp32_forward(layout, top_k, tiny_model_dir, teacher_dir, rollout, tmp_path):
    """TeacherWorker's log-prob of each sampled token (and its top-k log-probs and ids) are those
    of the teacher's own fp32 forward over the same sequences, at the rollout's temperature, in
    each layout the pass can take."""
    from transformers import AutoModelForCausalLM

    from fitrl.roles.teacher import TeacherWorker

    _, batch = rollout
    cfg = toy_config(tiny_model_dir, tmp_path, *distill(teacher_dir, f"algorithm.distill.top_k={top_k}"),
                     "rollout.temperature=0.7", "actor.logprob_chunk_size=5", "teacher.logprob_micro_batch_size=8",
                     *LAYOUTS[layout])
    worker = TeacherWorker(cfg, rank=0, world_size=1)
    assert isinstance(layout_of(worker.model, batch, layout), LAYOUT_TYPES[layout])
    out = worker.compute_teacher_logprob(batch)

    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    R = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -R - 1:-1].float() / 0.7
    logp = torch.log_softmax(logits, dim=-1)  # (B, R, V)
    live = batch["response_mask"].bool()
    want = logp.gather(-1, batch["responses"][..., None])[..., 0]
    assert live.sum() > 8 and torch.allclose(out["teacher_logprobs"][live], want[live], atol=1e-5)
    assert ("teacher_topk_ids" in out) == (top_k > 0)
    if top_k:
        values, ids = logp.topk(top_k, dim=-1)
        assert out["teacher_topk_ids"].dtype == torch.long and out["teacher_topk_ids"].shape == (len(batch), R, top_k)
        assert torch.equal(out["teacher_topk_ids"][live], ids[live])
        assert torch.allclose(out["teacher_topk_logprobs"][live], values[live], atol=1e-5)


# ------------------------------------------------------------------------------ the student's top-k pass


def test_the_fused_topk_head_has_autograd_s_gradient():
    """head_topk_logprobs (chunked, logits recomputed in backward) against autograd through the
    full log-softmax, with a temperature, a bias and chunks that do not divide the tokens."""
    from fitrl.roles.topk_heads import head_topk_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.stack([torch.randperm(11, generator=g)[:3] for _ in range(7)])
    upstream = torch.randn(7, 3, generator=g, dtype=torch.float64)

    def full():
        return torch.log_softmax((hidden @ weight.T + bias) / 0.8, dim=-1).gather(-1, ids)

    fused = head_topk_logprobs(hidden, ids, weight, bias, temperature=0.8, chunk_size=3)
    assert torch.allclose(fused.double(), full(), atol=1e-6)  # (the forward's logits are fp32)
    got = torch.autograd.grad((fused * upstream).sum(), [hidden, weight, bias])
    want = torch.autograd.grad((full() * upstream).sum(), [hidden, weight, bias])
    for a, b in zip(got, want):
        assert torch.allclose(a.double(), b, atol=1e-5), (a - b).abs().max()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_student_topk_pass_equals_full_logits(layout, tiny_model_dir, rollout):
    """The student's one forward for the top-k forward KL gives the log-probs, entropies and
    gradients of the plain pass, and at the teacher's ids the log-softmax of the full logits,
    with its gradients, in every layout."""
    import copy

    from fitrl.roles.topk_heads import student_topk_logprobs

    model, batch = rollout
    model = copy.deepcopy(model).train()
    R = batch["responses"].shape[1]
    live = batch["response_mask"].bool()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (len(batch), R, 4), generator=g)
    adv, w = torch.randn(len(batch), R, generator=g), torch.randn(len(batch), R, 4, generator=g)
    assert isinstance(layout_of(model, batch, layout), LAYOUT_TYPES[layout])
    params = list(model.parameters())

    lp, ent, topk = student_topk_logprobs(model, batch, ids, temperature=0.7, chunk_size=5, entropy_grad=True,
                                          share_prompts=layout == "shared", pack=layout == "packed")
    loss = (lp * adv * live).sum() + (ent * live).sum() + (topk * w * live[..., None]).sum()
    got = torch.autograd.grad(loss, params)

    plain_lp, plain_ent = response_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                            R, temperature=0.7, chunk_size=5, with_entropy=True, entropy_grad=True)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, -R - 1:-1].float() / 0.7
    want_topk = torch.log_softmax(logits, dim=-1).gather(-1, ids)
    want = torch.autograd.grad((plain_lp * adv * live).sum() + (plain_ent * live).sum()
                               + (want_topk * w * live[..., None]).sum(), params)
    assert torch.allclose(lp[live], plain_lp[live], atol=2e-5) and torch.allclose(ent[live], plain_ent[live], atol=2e-5)
    assert torch.allclose(topk[live], want_topk[live], atol=2e-5)
    for a, b in zip(got, want):
        assert (a - b).norm() <= 1e-5 * b.norm() + 1e-7, ((a - b).norm(), b.norm())


# ------------------------------------------------------------------------------ a run with a teacher


@pytest.mark.parametrize("loss,mini", [("reverse_kl", 2), ("reverse_kl", 4), ("topk_forward_kl", 2)],
                         ids=["reverse_kl-off-policy", "reverse_kl-on-policy", "topk_forward_kl"])
def test_two_steps_with_a_teacher_train_log_and_plan_it(loss, mini, tiny_model_dir, teacher_dir, tmp_path):
    """Two in-process steps: the teacher's phase is timed and memory-recorded, the distillation
    metrics are logged, the policy trains, and the plan holds the teacher's states and phase (and
    under Ray its process of its own). Two optimizer steps per RL step take the reverse KL through
    the policy loss against the rollout's log-probs; one on fresh samples is the on-policy form,
    whose value is the sampled tokens' KL itself."""
    from fitrl.memory.model import Hardware
    from fitrl.memory.states import frozen_states
    from fitrl.models.shape import ModelShape
    from fitrl.planner import plan_config
    from fitrl.trainer.run import train

    run = tmp_path / "run"
    cfg = toy_config(tiny_model_dir, run, *SMALL, "trainer.max_steps=2", "trainer.val_freq=0", "data.val_files=[]",
                     f"actor.mini_batch_size={mini}",
                     *distill(teacher_dir, f"algorithm.distill.loss={loss}", "algorithm.distill.top_k=4"))
    history = train(cfg)
    assert len(history) == 2
    records = read_metrics(run)
    for step in records:
        assert step["time/teacher_logprob"] > 0 and "mem/rank0/teacher_logprob/host_peak_gib" in step
        assert 0.0 <= step["distill/teacher_agreement"] <= 1.0 and step["distill/teacher_logprob"] < 0
        assert torch.isfinite(torch.tensor([step["distill/loss"], step["distill/reverse_kl"], step["actor/grad_norm"]])).all()
        assert step["actor/grad_norm"] > 0
    if loss == "topk_forward_kl":
        assert all(r["distill/forward_kl_topk"] >= 0 and r["distill/loss"] == pytest.approx(r["distill/forward_kl_topk"])
                   for r in records)
    elif mini == 4:  # (the update's own forward is the behaviour policy: old_logprob never runs)
        assert all(r["distill/loss"] == pytest.approx(r["distill/reverse_kl"]) and "time/old_logprob" not in r
                   for r in records)
    else:
        assert all("time/old_logprob" in r for r in records)

    plan = plan_config(cfg, Hardware.cpu(1, host_memory=64 * 2**30))
    assert "teacher_logprob" in plan.phases and plan.layout.builds("teacher")
    trainer = next(p for p in plan.processes if p.kind == "trainer")
    phase = trainer.phases["teacher_logprob"].host
    teacher = frozen_states(ModelShape.from_path(teacher_dir), 1, "float32").params  # its own shape, not the policy's
    assert phase["teacher params"] == teacher > phase["params"]
    # its top-k outputs while it runs (fitrl/memory/distill.py): the earlier micro-batches' (4 + 20k bytes a
    # token) while the last one runs, or the concatenation at its end (8 + 32k) above the freed forward
    earlier = (16 - min(cfg.teacher.logprob_micro_batch_size, 16)) * 8 * (4 + 20 * 4)
    assert phase["activations"] > 0 and earlier <= phase.get("top-k buffers", 0) <= max(earlier, 16 * 8 * (8 + 32 * 4))
    assert all(u.host["teacher params"] == teacher for u in trainer.phases.values())  # its weights in every phase
    assert trainer.phases["update"].host["top-k buffers"] == 16 * 8 * 4 * 12  # what the update's batch carries
    ray = toy_config(tiny_model_dir, run, *SMALL, "trainer.backend=ray", "trainer.devices_per_node=2",
                     "trainer.device=cpu", *distill(teacher_dir, "algorithm.distill.top_k=4"))
    kinds = {p.kind: p for p in plan_config(ray, Hardware.cpu(2, host_memory=64 * 2**30)).processes}
    assert "teacher params" in kinds["teacher"].phases["teacher_logprob"].host
    assert "teacher params" not in kinds["trainer"].phases["teacher_logprob"].host


@pytest.mark.slow
def test_resume_mid_run_equals_an_uninterrupted_run(tiny_model_dir, teacher_dir, tmp_path):
    """Resuming a distillation run's step-2 checkpoint in a fresh run directory reproduces the
    uninterrupted run (the teacher is frozen and rebuilt from its path: nothing of it is saved).
    Pure distillation, weight 1: the rewards are computed and logged, the teacher alone trains."""
    from fitrl.trainer.run import train

    common = [*SMALL, "trainer.max_steps=4", "trainer.val_freq=2", "checkpoint.save_freq=2",
              *distill(teacher_dir, "algorithm.distill.weight=1", "algorithm.distill.top_k=3")]
    train(toy_config(tiny_model_dir, tmp_path / "a", *common))
    train(toy_config(tiny_model_dir, tmp_path / "b", *common,
                     f"checkpoint.resume={tmp_path / 'a' / 'checkpoints' / 'step_2'}"))
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert comparable(b) == comparable(a)
    steps = [r for r in a if "distill/loss" in r]
    assert len(steps) == 4 and all("reward/mean" in r for r in steps)


def test_a_lora_student_distills_toward_the_teacher_beside_its_reference(tiny_model_dir, teacher_dir, tmp_path):
    """A LoRA student (its reference is the base with the adapters off) trains toward the teacher,
    which is a model of its own beside the reference."""
    from fitrl.trainer.run import train

    run = tmp_path / "run"
    cfg = toy_config(tiny_model_dir, run, *SMALL, "trainer.max_steps=2", "trainer.val_freq=0", "data.val_files=[]",
                     "actor.lora.rank=4", "actor.lora.alpha=8", "algorithm.use_kl_loss=true", "algorithm.kl_coef=0.01",
                     *distill(teacher_dir, "algorithm.distill.weight=0.5", "algorithm.distill.loss=topk_forward_kl",
                              "algorithm.distill.top_k=4"))
    train(cfg)
    records = read_metrics(run)
    assert len(records) == 2 and all(r["actor/grad_norm"] > 0 and r["distill/forward_kl_topk"] >= 0 for r in records)
    assert all(r["time/teacher_logprob"] > 0 and r["time/ref"] > 0 for r in records)


def test_a_checkpoint_saved_before_distillation_resumes(tiny_model_dir, tmp_path):
    """A checkpoint's config.yaml written before ``teacher`` and ``algorithm.distill`` existed was
    saved with their defaults: resuming it with them at their defaults is no change of config."""
    import yaml
    from types import SimpleNamespace

    from rich.console import Console

    from fitrl.checkpoint.manager import CheckpointManager
    from fitrl.config import save_config

    cfg = toy_config(tiny_model_dir, tmp_path / "run", *SMALL)
    save_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del saved["teacher"], saved["algorithm"]["distill"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    CheckpointManager(cfg, tmp_path / "run", Console(quiet=True))._check_config(SimpleNamespace(path=tmp_path))


# ------------------------------------------------------------------------------ roles built = roles planned


@pytest.mark.parametrize("overrides,supervised", [
    ([], False), (["trainer.val_only=true"], False), ([], True),
    (["trainer.backend=ray", "trainer.devices_per_node=2"], False),
    (["trainer.backend=ray", "trainer.devices_per_node=2", "rollout.workers=2", "rollout.mode=one_step_off",
      "algorithm.use_kl_loss=true"], False),
], ids=["rl", "val_only", "supervised", "ray", "ray-workers-kl"])
def test_the_teacher_built_is_the_teacher_planned(overrides, supervised, tiny_model_dir, tmp_path, built_groups):
    from fitrl.config.layout import run_layout

    cfg = toy_config(tiny_model_dir, tmp_path / "run", "trainer.device=cpu", "trainer.val_before_train=false",
                     *distill(tiny_model_dir), *overrides)
    check_built_is_planned(cfg, supervised, *built_groups, tiny_model_dir)
    teacher = run_layout(cfg, supervised).role("teacher")
    assert (teacher is not None) == (not supervised and "trainer.val_only=true" not in overrides)
    if teacher is not None:
        assert teacher.colocated and teacher.own_model
        assert any(b.role == "teacher" and b.colocated_with == "actor" for b in built_groups[0])


def test_a_supervised_run_turns_distillation_off_and_plans_no_teacher_phase(tiny_model_dir, tmp_path):
    from fitrl.planner import Hardware, plan_config
    from fitrl.trainer.sft import supervised_config

    cfg = toy_config(tiny_model_dir, tmp_path / "run", "trainer.device=cpu", *distill(tiny_model_dir))
    notes = supervised_config(cfg)  # what `fitrl sft` does before the run
    assert cfg.algorithm.distill.weight == 0.0
    assert any(n.startswith("algorithm.distill.weight=0 (was 0.5") for n in notes), notes
    plan = plan_config(cfg, Hardware.cpu(host_memory=64 * 2**30), supervised=True)
    assert "teacher_logprob" not in plan.phases


# ------------------------------------------------------------------------------ bad inputs


def other_tokenizer(ws):
    """A teacher whose tokenizer is trained on another corpus (the agent example's)."""
    from fitrl.models.tiny import make_tiny_model

    return make_tiny_model(ws.root / "teacher-agent", arch="qwen2", size="agent", seed=1)


def with_teacher(teacher, *extra, new: bool = False):
    """``prepare``: train on the existing finished run (``new``: a fresh run directory) with a
    teacher (``teacher(ws)``: its directory)."""
    return lambda ws: ws.train_args(*distill(teacher(ws), *extra), **({} if new else {"run_dir": ws.run}))


CASES = [
    Case("distill-without-teacher", "config", on_new("algorithm.distill.weight=0.5"),
         r"^fitrl: config error: algorithm\.distill\.weight=0\.5 distills from a teacher, and none is set: set "
         r"teacher\.model\.path", check=no_new_run_dir),
    Case("distill-weight-above-1", "config", on_new("algorithm.distill.weight=1.5", "teacher.model.path=/x"),
         r"algorithm\.distill\.weight must be in \[0, 1\] \(0: pure RL, 1: pure distillation\), got 1\.5",
         check=no_new_run_dir),
    Case("distill-weight-negative", "config", on_new("algorithm.distill.weight=-0.1", "teacher.model.path=/x"),
         r"algorithm\.distill\.weight must be in \[0, 1\]", check=no_new_run_dir),
    Case("distill-topk-without-k", "config", on_new(*distill("/x", "algorithm.distill.loss=topk_forward_kl")),
         r"algorithm\.distill\.loss=topk_forward_kl needs the teacher's top-k tokens: set algorithm\.distill\.top_k",
         check=no_new_run_dir),
    Case("distill-topk-larger-than-vocabulary", "config",
         with_teacher(lambda ws: ws.model, "algorithm.distill.top_k=100000"),
         r"algorithm\.distill\.top_k=100000: top-k 100000 is larger than the vocabulary \(\d+ tokens\); set k <= \d+"),
    Case("distill-topk-larger-than-vocabulary-new-run", "config",
         with_teacher(lambda ws: ws.model, "algorithm.distill.top_k=513", new=True),
         r"algorithm\.distill\.top_k=513: top-k 513 is larger than the vocabulary \(512 tokens\)", check=no_new_run_dir),
    Case("distill-teacher-path-misspelt", "model", with_teacher(lambda ws: ws.root / "tecaher"),
         r"teacher\.model\.path='.*tecaher' does not exist"),
    Case("distill-tokenizer-mismatch", "model", with_teacher(other_tokenizer),
         r"model error: the teacher's tokenizer \(.*teacher-agent, teacher\.model\.path\) is not the actor's "
         r"\(.*/model, actor\.model\.path\): .*both must share one tokenizer"),
    Case("distill-tokenizer-mismatch-new-run", "model", with_teacher(other_tokenizer, new=True),
         r"the teacher's tokenizer \(.*teacher-agent, teacher\.model\.path\) is not the actor's", check=no_new_run_dir),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bad_distillation_input(case, workspace):
    out = run_case(case, workspace)
    text = (out.stderr + out.stdout).strip()
    assert len([line for line in out.stderr.splitlines() if line.startswith("fitrl:")]) == 1, text


# ------------------------------------------------------------------------------ two FSDP2 ranks


@pytest.mark.slow
def test_two_fsdp_ranks_score_what_one_process_scores(ray_cluster, tiny_model_dir, teacher_dir, rollout, tmp_path):
    """The teacher sharded over 2 Ray ranks (FSDP2, gloo) gives the one process's log-probs and top-k."""
    from fitrl.roles.teacher import TeacherWorker
    from fitrl.workers.group import RoleHandle
    from fitrl.workers.ray_group import RayWorkerGroup

    _, batch = rollout
    extra = distill(teacher_dir, "algorithm.distill.top_k=4")
    one = TeacherWorker(toy_config(tiny_model_dir, tmp_path, *extra), rank=0, world_size=1)
    want = one.compute_teacher_logprob(batch)
    cfg = toy_config(tiny_model_dir, tmp_path, *extra, "trainer.backend=ray", "trainer.devices_per_node=2",
                     "trainer.device=cpu", *SMALL)
    with RayWorkerGroup(TeacherWorker, cfg, world_size=2, name="teacher") as group:
        got = RoleHandle(group).compute_teacher_logprob(batch)  # each rank 4 of the 8 sequences
    live = batch["response_mask"].bool()
    assert torch.allclose(got["teacher_logprobs"][live], want["teacher_logprobs"][live], atol=1e-5)
    assert torch.equal(got["teacher_topk_ids"][live], want["teacher_topk_ids"][live])
    assert torch.allclose(got["teacher_topk_logprobs"][live], want["teacher_topk_logprobs"][live], atol=1e-5)
