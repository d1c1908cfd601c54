"""AdamW: torch's fused kernel where the parameters allow it, the same update as the default."""

import torch

from fitrl.config.schema import OptimConfig
from fitrl.roles.actor import build_optimizer, can_fuse


def steps(fused: bool, n: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1, fused=fused))
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step()
    return model, opt


def test_fused_is_used_on_cpu_and_gives_the_default_update():
    fused_model, fused_opt = steps(True)
    plain_model, plain_opt = steps(False)
    assert fused_opt.defaults["fused"] and not plain_opt.defaults.get("fused")
    for a, b in zip(fused_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_state_moves_between_implementations():
    """A checkpoint of one loads into the other (resuming with optim.fused changed)."""
    fused_model, fused_opt = steps(True)
    _, plain_opt = steps(False, n=0)
    plain_opt.load_state_dict(fused_opt.state_dict())
    state = plain_opt.state_dict()["state"][0]
    assert float(state["step"]) == 3 and state["exp_avg"].shape == (32, 16)


def test_parameters_the_kernel_cannot_take_fall_back():
    assert can_fuse([torch.zeros(2), torch.zeros(3, dtype=torch.bfloat16)])
    assert not can_fuse([torch.zeros(2, dtype=torch.float64)])
    assert not can_fuse([torch.zeros(2, device="meta")])
    model = torch.nn.Linear(2, 2).double()
    assert not build_optimizer(model, OptimConfig()).defaults.get("fused")
