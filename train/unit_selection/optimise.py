"""Gate optimisation (DuoAttention, Xiao et al. 2024, arXiv 2410.10819, §3.2, adapted to POD).

The model is frozen; the only parameters are the gates ``alpha[L, Hkv]`` of the candidate map's shared units
(``train/unit_selection/gated_forward.py``). Each step takes one batch of synthetic retrieval samples and
minimises

    distill(alpha) + l1_weight * mean(alpha over shared units)

where ``distill`` is the squared distance of the gated model's final hidden states to the dense model's at the
loss positions (the answer positions of the samples), divided by the dense states' mean squared norm so that
``l1_weight`` means the same on every hidden size. DuoAttention's choices are kept: gates start at 1 (dense),
Adam, and each gate is clamped to [0, 1] after every step. The L1 term pushes every gate toward 0 (share the
anchor's keys); a unit whose sharing hurts the answers keeps a high gate.
"""

from __future__ import annotations

import torch

from train.unit_selection.gated_forward import GatedPodForward


def relative_distance(hidden: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum ||h - h_ref||^2 / sum ||h_ref||^2`` over the positions of ``mask[B,S]``; hidden ``[B,S,H]``."""
    h, r = hidden[mask].float(), reference[mask].float()
    return (h - r).pow(2).sum() / r.pow(2).sum().clamp_min(1e-12)


def optimise_gates(gated: GatedPodForward, ids: torch.Tensor, loss_mask: torch.Tensor, *, steps: int, lr: float,
                   l1_weight: float, batch_size: int = 1, seed: int = 0, log=None) -> dict:
    """Learn the gates on ``ids[N,S]`` with loss positions ``loss_mask[N,S]``.

    Batches of ``batch_size`` rows are drawn in a seeded order, cycling over the N samples. Returns
    ``{"alpha": [L, Hkv] tensor (1.0 at anchors), "curve": [{"step", "loss", "distill", "mean_alpha"}]}``.
    """
    if not bool(loss_mask.any()):
        raise ValueError("the samples have no loss position")
    device = next(gated.model.parameters()).device
    gated.freeze()
    shared = gated.shared_mask().to(device)
    if not bool(shared.any()):
        raise ValueError("the candidate block map has no shared unit: nothing to gate")
    alpha = torch.ones(gated.num_layers, gated.num_kv_heads, device=device, requires_grad=True)
    optimiser = torch.optim.Adam([alpha], lr=lr)
    ids, loss_mask = ids.to(device), loss_mask.to(device)
    with torch.no_grad():  # the dense model's states: the targets, computed once
        reference = torch.cat([gated(ids[i:i + batch_size], torch.ones_like(alpha))
                               for i in range(0, len(ids), batch_size)])
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))
    curve = []
    for step in range(steps):
        pick = order[torch.arange(step * batch_size, (step + 1) * batch_size) % len(ids)].to(device)
        hidden = gated(ids[pick], alpha)
        distill = relative_distance(hidden, reference[pick], loss_mask[pick])
        mean_alpha = alpha[shared].mean()
        loss = distill + l1_weight * mean_alpha
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        with torch.no_grad():
            alpha.clamp_(0.0, 1.0)
        curve.append({"step": step + 1, "loss": float(loss.detach()), "distill": float(distill.detach()),
                      "mean_alpha": float(mean_alpha.detach())})
        if log is not None and (step == 0 or (step + 1) % max(1, steps // 10) == 0):
            point = curve[-1]
            log(f"[units] step {step + 1}/{steps}: loss {point['loss']:.4f} (distill {point['distill']:.4f}, "
                f"mean alpha {point['mean_alpha']:.3f})")
    final = alpha.detach().where(shared, torch.ones_like(alpha)).cpu()
    return {"alpha": final, "curve": curve}
