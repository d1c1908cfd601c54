"""Resharding: a checkpoint saved by 2 FSDP2 ranks (Ray, gloo) loads into 1 process and the
other way round, weights and AdamW moments included; and a whole run saved under Ray resumes
in-process. Marked slow (each group starts 2 worker processes)."""

import pytest
import torch

from fitrl.checkpoint import layout
from fitrl.data.batch import Batch
from fitrl.roles.workers import PolicyWorker
from fitrl.config.schema import SamplingConfig
from fitrl.workers.group import RoleHandle
from helpers import read_metrics, toy_config

pytestmark = pytest.mark.slow

BATCH = ["data.rollout_batch_size=4", "rollout.n=2", "actor.mini_batch_size=4", "actor.micro_batch_size=2",
         "trainer.device=cpu", "actor.optim.lr=1e-4", "actor.optim.warmup_steps=0"]
RAY = ["trainer.backend=ray", "trainer.devices_per_node=2"]


@pytest.fixture(scope="module")
def batches(tiny_model_dir, tmp_path_factory):
    """Two scored rollout batches, the second with the opposite advantages: its AdamW step
    depends strongly on the first step's moments (without them it would be ~20x larger)."""
    worker = PolicyWorker(toy_config(tiny_model_dir, tmp_path_factory.mktemp("run"), *BATCH), rank=0, world_size=1)
    tok = worker.tokenizer
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": f"What is {i} + 3?"}], add_generation_prompt=True,
                                       tokenize=False), add_special_tokens=False)["input_ids"] for i in range(4)]
    torch.manual_seed(0)
    b = worker.generate(Batch(fields={"prompt_ids": ids}), SamplingConfig(n=2, max_tokens=6))
    b.update(worker.compute_logprob(b))
    b.update(advantages=torch.randn(len(b), 1, generator=torch.Generator().manual_seed(1)) * b["response_mask"])
    second = b.index(list(range(len(b))))
    second.update(advantages=-b["advantages"])
    return b, second


def worst(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def policy(model_dir, run_dir, *extra) -> PolicyWorker:
    return PolicyWorker(toy_config(model_dir, run_dir, *BATCH, *extra), rank=0, world_size=1)


def test_two_ranks_save_one_process_resumes(ray_cluster, tiny_model_dir, tmp_path, batches):
    from fitrl.workers.ray_group import RayWorkerGroup

    first, second = batches
    with RayWorkerGroup(PolicyWorker, toy_config(tiny_model_dir, tmp_path, *BATCH, *RAY), world_size=2,
                        name="policy") as group:
        two = RoleHandle(group)
        two.update(first)
        two.save_checkpoint(str(tmp_path / "actor"))
        saved = two.state_dict()
        m_two = two.update(second)
        after_two = two.state_dict()
    assert sorted(p.name for p in (tmp_path / "actor").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    resumed = policy(tiny_model_dir, tmp_path)
    resumed.load_checkpoint(str(tmp_path / "actor"))
    assert worst(resumed.state_dict(), saved) == 0.0
    assert resumed.actor.num_updates == 1
    m_resumed = resumed.update(second)  # uses the resharded AdamW moments
    assert m_resumed["actor/grad_norm"] == pytest.approx(m_two["actor/grad_norm"], rel=1e-5)
    assert worst(resumed.state_dict(), after_two) <= 1e-6

    weights_only = policy(tiny_model_dir, tmp_path)
    weights_only.load_checkpoint(str(tmp_path / "actor"), weights_only=True)
    weights_only.update(second)
    assert worst(weights_only.state_dict(), after_two) > 1e-5  # the comparison above is sensitive to the moments


def test_one_process_saves_two_ranks_resume(ray_cluster, tiny_model_dir, tmp_path, batches):
    from fitrl.workers.ray_group import RayWorkerGroup

    first, second = batches
    one = policy(tiny_model_dir, tmp_path)
    one.update(first)
    one.save_checkpoint(str(tmp_path / "actor"))
    with RayWorkerGroup(PolicyWorker, toy_config(tiny_model_dir, tmp_path, *BATCH, *RAY), world_size=2,
                        name="policy") as group:
        two = RoleHandle(group)
        two.load_checkpoint(str(tmp_path / "actor"))
        assert worst(two.state_dict(), one.state_dict()) == 0.0
        m_two = two.update(second)
        state = two.state_dict()
    m_one = one.update(second)
    assert m_two["actor/grad_norm"] == pytest.approx(m_one["actor/grad_norm"], rel=1e-5)
    assert worst(state, one.state_dict()) <= 1e-6


def test_run_saved_under_ray_resumes_in_process(ray_cluster, tiny_model_dir, tmp_path):
    from fitrl.trainer.run import train

    run = tmp_path / "run"
    common = ["trainer.val_before_train=false", "data.val_files=[]", "actor.micro_batch_size=16"]
    train(toy_config(tiny_model_dir, run, *common, *RAY, "trainer.max_steps=2"))
    saved = layout.read(run / "checkpoints" / "step_2")
    assert saved.meta["world_size"] == 2 and "actor/__1_0.distcp" in saved.meta["files"]
    train(toy_config(tiny_model_dir, run, *common, "trainer.max_steps=3"))  # auto-resume, one process
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert [c.step for c in layout.list_complete(run / "checkpoints")] == [2, 3]
