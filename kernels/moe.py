"""A mixture of experts: each token routed to its top-k experts, and the experts' gated MLPs
summed by the routing weights (Qwen3-MoE, Mixtral; shared/model_config.MoeConfig).

These are the plain-torch references. Neither syncs with the host (ids stay on the device),
so a CUDA graph can hold them; the experts' reference runs every expert over every token, E
times the work of the chosen ones, until the grouped-GEMM kernel replaces it on the GPU.
"""

from __future__ import annotations

import torch

from kernels.activation import silu_and_mul_reference


def moe_route_reference(
    logits: torch.Tensor,  # [T, E]: the router's, in the model's dtype
    top_k: int,
    renormalize: bool,  # rescale the chosen experts' probabilities to sum to 1
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] float32, expert ids [T, k] int64
    """Softmax over all experts in float32, then the top k (as transformers routes)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts_reference(
    x: torch.Tensor,  # [T, H]
    gate_up: torch.Tensor,  # [E, 2 I, H]: each expert's gate rows, then its up rows
    down: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, k] float32
    ids: torch.Tensor,  # [T, k] int
) -> torch.Tensor:  # [T, H], x's dtype
    """sum over a token's k experts e of weight * down_e(silu(gate_e x) * up_e x), summed in
    float32 in ascending expert order."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        share = (weights * (ids == expert)).sum(dim=-1)  # [T]: 0 where not chosen
        hidden = silu_and_mul_reference(x @ gate_up[expert].T)  # [T, I]
        out += share[:, None] * (hidden @ down[expert].T).float()
    return out.to(x.dtype)
