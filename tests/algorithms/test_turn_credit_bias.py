"""Per-turn rewards with a policy that chooses how many turns to take: the baseline must not be the turn index's.

Pure maths, many sampled groups. The policy stops after turn k with probability σ(θ) (turn K always stops); turn k
pays c_k. The exact gradient of the expected return is known in closed form (autograd on the enumeration). Each
row's decision at the end of turn k has score ∂/∂θ log π (1 − σ for stop, −σ for go on) and is credited with an
advantage:

- ours (`tree_credit`, no branch, weights (1, 0)): return-to-go G_k − mean over the group of the total returns,
  a baseline that depends only on the prompt. Its expectation is (1 − 1/n)·∇J exactly (the row's own return in the
  group mean scales every term alike), so the direction is unbiased;
- turn index: G_k − mean of G_k over the rows of the group that reached turn k. The row's own weight in that mean,
  1/m_k, depends on how many rows reached turn k, which the stopping decisions choose: turns are reweighted
  unequally and the gradient shifts.
"""

import torch

from appo_trl.algorithms.tree_credit import tree_credit

K, N, GROUPS = 3, 4, 100_000
C = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)  # reward of each turn


def exact_gradient(theta: float) -> float:
    th = torch.tensor(theta, dtype=torch.float64, requires_grad=True)
    p = torch.sigmoid(th)
    probs = torch.stack([p, (1 - p) * p, (1 - p) ** 2])  # P(stop after 1, 2, 3 turns)
    returns = C.cumsum(0)
    return torch.autograd.grad((probs * returns).sum(), th)[0].item()


def sample(theta: float, groups: int, seed: int):
    """Per (group, row, turn): reached, return-to-go G, score."""
    g = torch.Generator().manual_seed(seed)
    p = torch.sigmoid(torch.tensor(theta, dtype=torch.float64)).item()
    stop = torch.rand(groups, N, K - 1, generator=g, dtype=torch.float64) < p
    turns = torch.full((groups, N), K)
    for k in range(K - 2, -1, -1):
        turns = torch.where(stop[..., k], torch.tensor(k + 1), turns)
    ks = torch.arange(1, K + 1).view(1, 1, K)
    reached = ks <= turns.unsqueeze(-1)
    G = (C.view(1, 1, K) * reached).flip(-1).cumsum(-1).flip(-1)
    score = torch.where(ks == turns.unsqueeze(-1), 1 - p, -p) * reached * (ks < K)
    return reached, G, score, turns


def ours(G, reached):
    return (G - G[..., :1].mean(1, keepdim=True)) * reached


def turn_index(G, reached):
    b = (G * reached).sum(1, keepdim=True) / reached.sum(1, keepdim=True).clamp(min=1)
    return (G - b) * reached


def test_ours_is_the_estimator_on_turn_tokens():
    """The vectorised `ours` is `tree_credit` on one token per turn, each turn's reward on it (a few groups)."""
    reached, G, _, turns = sample(0.3, 5, seed=1)
    adv = ours(G, reached)
    for g in range(5):
        lengths = turns[g].tolist()
        tr = torch.zeros(N, K, dtype=torch.float64)
        for i, n in enumerate(lengths):
            tr[i, :n] = C[:n]
        got = tree_credit([-1] * N, [0] * N, lengths, token_rewards=tr, weights=(1.0, 0.0), scale="none")
        for i, n in enumerate(lengths):
            assert torch.allclose(got.advantages[i, :n].double(), adv[g, i, :n], atol=1e-6)


def test_turn_index_baseline_shifts_the_gradient_ours_does_not():
    theta = 0.3
    truth = exact_gradient(theta)
    reached, G, score, _ = sample(theta, GROUPS, seed=0)
    scale = 1 - 1 / N
    z = {}
    for name, adv in (("ours", ours(G, reached)), ("turn_index", turn_index(G, reached))):
        per_group = (score * adv).sum(-1).mean(1) / scale
        se = per_group.std().item() / GROUPS**0.5
        z[name] = (per_group.mean().item() - truth) / se
    assert abs(z["ours"]) < 4, z  # unbiased (within 4 standard errors)
    assert abs(z["turn_index"]) > 20, z  # shifted far beyond the sampling error
