"""Sharding is a registered backend (fitrl/distributed/sharding.py, fitrl/memory/sharding.py):
FSDP2 is one, in its own folder (fitrl/sharding/fsdp2/), and nothing else in fitrl imports its
primitives or names it in the planner. A dummy backend of the test's own ("replicate",
tests/sharding_dummy.py) shows the seam: without its planner the completeness check fails and no
plan is made; with it, the plan follows its choices, and ``build_model`` builds through it on two
gloo ranks."""

import pickle
import subprocess
from pathlib import Path

import pytest

import fitrl.sharding  # noqa: F401  (registers the built-in backend)
from fitrl.config import ConfigError
from fitrl.distributed.sharding import PLAIN, SHARDING_BACKENDS, backend_of, sharded_over_ranks
from fitrl.memory import calibration as C
from fitrl.memory.sharding import SHARDING_PLANNERS
from fitrl.planner import Hardware, plan_config
from fitrl.trainer.complete import missing_counterparts
from helpers import toy_config
from sharding_dummy import ReplicateBackend, ReplicatePlanner

ROOT = Path(__file__).resolve().parent.parent
GPUS = Hardware(nodes=1, gpus_per_node=8, gpu_memory=80 * C.GIB, host_memory=1024 * C.GIB, device="cuda")


@pytest.fixture
def replicate():
    SHARDING_BACKENDS.add("replicate", ReplicateBackend())
    yield
    SHARDING_BACKENDS.remove("replicate")
    if "replicate" in SHARDING_PLANNERS:
        SHARDING_PLANNERS.remove("replicate")


def _git_grep(*args: str) -> list[str]:
    out = subprocess.run(["git", "grep", "--untracked", "-n", *args], cwd=ROOT, capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line]


def _code(lines: list[str]) -> list[str]:
    """The grep hits that are code: neither a comment nor in a docstring (a string standing alone
    as a statement), found with ``ast`` and ``tokenize``."""
    prose: dict[str, set[int]] = {}
    out = []
    for line in lines:
        path, number, text = line.split(":", 2)
        if path not in prose:
            prose[path] = _prose_lines(ROOT / path)
        if int(number) not in prose[path]:
            out.append(line)
    return out


def _prose_lines(path: Path) -> set[int]:
    """Lines of ``path`` that hold only a comment, or lie in a docstring."""
    import ast
    import io
    import tokenize

    source = path.read_text()
    prose = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            prose.update(range(node.lineno, node.end_lineno + 1))
    comments, code = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.add(tok.start[0])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code.update(range(tok.start[0], tok.end[0] + 1))
    return prose | (comments - code)


def test_the_planner_and_the_engines_plans_never_name_fsdp():
    found = _git_grep("fsdp", "--", "fitrl/memory", "fitrl/planner", "fitrl/rollout/*_plan.py")
    assert _code(found) == []


def test_only_the_backend_folder_imports_the_fsdp2_primitives():
    found = _git_grep("-l", "from fitrl.distributed.fsdp import\\|from fitrl.distributed import fsdp", "--", "fitrl")
    assert found and all(path.startswith("fitrl/sharding/fsdp2/") for path in found), found


def test_every_builtin_backend_has_its_planner():
    assert missing_counterparts() == []
    assert SHARDING_BACKENDS.names() == ["fsdp2"] and SHARDING_PLANNERS.names() == ["fsdp2"]


def test_a_misspelt_backend_is_one_line_with_the_valid_names(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"unknown sharding backend critic.sharding='fsdp'; did you mean 'fsdp2'\? "
                                          r"\(valid: fsdp2\)"):
        toy_config(tiny_model_dir, tmp_path, "critic.sharding=fsdp")


def test_a_backend_without_a_planner_fails_the_check_then_plans_with_one(replicate, tiny_model_dir, tmp_path):
    assert missing_counterparts() == ["sharding backend 'replicate' has no memory planner (fitrl/memory/sharding.py, "
                                      "SHARDING_PLANNERS)"]
    ray = ("trainer.backend=ray", "trainer.devices_per_node=8", "trainer.val_before_train=false")
    cfg = toy_config(tiny_model_dir, tmp_path, *ray, "actor.sharding=replicate")
    with pytest.raises(ConfigError, match="unknown sharding backend memory planner"):
        plan_config(cfg, GPUS)  # never a plan without the backend's memory

    SHARDING_PLANNERS.add("replicate", ReplicatePlanner())
    assert missing_counterparts() == []
    whole = plan_config(cfg, GPUS).process("trainer").phases["update"].gpu
    sharded = plan_config(toy_config(tiny_model_dir, tmp_path, *ray), GPUS).process("trainer").phases["update"].gpu
    # a whole copy of the weights, gradients and AdamW states on every rank, nothing gathered; FSDP2 an eighth
    for part in ("params", "grads", "optimizer"):
        assert whole[part] > 6 * sharded[part], part
    assert "gathered weights" not in whole and sharded["gathered weights"] > 0


def _load(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def test_a_whole_module_belongs_to_no_backend(tiny_model_dir):
    model = _load(tiny_model_dir)
    assert backend_of(model) is PLAIN and not sharded_over_ranks(model)
    assert PLAIN.units(model) == []


@pytest.mark.slow
def test_build_model_shards_through_a_registered_backend_on_two_ranks(tiny_model_dir):
    """Two gloo ranks build the policy through the dummy backend: rank 1 on ``meta``, filled from
    rank 0's checkpoint read; both compute rank 0's logits from the file's weights."""
    import torch
    import torch.multiprocessing as mp

    from fitrl.distributed.process_group import free_port
    from fsdp_spawn import replicated_on_rank

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=replicated_on_rank, args=(r, 2, port, str(tiny_model_dir), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    model = _load(tiny_model_dir)
    with torch.no_grad():
        expected = model(input_ids=torch.arange(1, 9).unsqueeze(0)).logits
    for rank, name, sharded, filled, logits in results:
        assert (name, sharded, filled) == ("replicate", False, "rank0"), rank
        torch.testing.assert_close(pickle.loads(logits), expected)
