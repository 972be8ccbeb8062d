"""A mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral): a router picks each token's
top ``k`` experts, each a gated MLP, and the token's output is their weighted sum.

Routing is transformers' (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``): the router's
logits in the dtype, their softmax in float32, ``torch.topk`` of it (ties break as
``torch.topk`` breaks them there), renormalised to sum to 1 where ``norm_topk_prob``, cast
back to the logits' dtype.

Experts run as grouped work: the batch's ``T k`` (token, expert) pairs are sorted by
expert (stably: token order within an expert) and each active expert projects its run of
rows in one call of its own packed weights (``GatedMLP.project``, in the model's weight
format: with ``--quantization gguf`` a GGUF file's own blocks); an expert no token chose
computes nothing. A token's weighted outputs are summed in ascending expert order, the
first taken as it is, as transformers' ``index_add_`` over the experts in order sums them
(so float32 sums round alike). A shared expert (Qwen2-MoE) adds ``sigmoid(x .
shared_expert_gate) shared_expert(x)`` to that sum.

Checkpoint names are transformers' per-expert ones (``mlp.gate``,
``mlp.experts.E.{gate,up,down}_proj``, ``mlp.shared_expert``, ``mlp.shared_expert_gate``);
``check_expert_weight`` refuses a tensor that disagrees with the config's experts.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.models.config import ModelConfig
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.mlp import GatedMLP
from tokenmill.models.layers.ops import LayerOps
from tokenmill.models.weights.formats import WeightFormat

_EXPERT_WEIGHT = re.compile(r"model\.layers\.(\d+)\.mlp\.(?:experts\.(\d+)\.(\w+)|gate)\.weight$")


class SparseMoeBlock(nn.Module):
    """``residual + sum over the top-k experts e of w_e expert_e(x)`` (see the module
    docstring); the router (``gate``, ``[experts, hidden]``) keeps plain weights in the
    dtype, as transformers' does, the experts take ``weight_format``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 ops: LayerOps, weight_format: WeightFormat | None):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, False, dtype, device)
        self.experts = nn.ModuleList(
            GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size, dtype, device, ops,
                     weight_format, cfg.hidden_act)
            for _ in range(cfg.num_experts))
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                                          dtype, device, ops, weight_format, cfg.hidden_act)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, False, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + self.project(x)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] in the dtype, experts [T, k] int64)``, in ``torch.topk``'s
        order (see the module docstring)."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output ``[T, H]`` for ``x [T, H]``, no residual."""
        weights, experts = self.route(x)
        experts, by_expert = experts.sort(dim=-1)  # each token's experts ascending
        out = self.run_experts(x, experts) * weights.gather(1, by_expert).unsqueeze(-1)
        total = out[:, 0]
        for j in range(1, self.top_k):
            total = total + out[:, j]
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            total = total + gate * self.shared_expert.project(x)
        return total

    def run_experts(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``expert_e(x_t)`` for each pair (t, e) of ``experts [T, k]``: ``[T, k, H]``, one
        call per active expert over its rows (see the module docstring)."""
        tokens, k = experts.shape
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        rows = x[order // k]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        outs, start = [], 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                outs.append(expert.project(rows[start:start + count]))
                start += count
        grouped = torch.cat(outs)
        out = torch.empty_like(grouped)
        out[order] = grouped
        return out.view(tokens, k, -1)


def check_expert_weight(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> None:
    """Raises ``ModelLoadError`` naming what disagrees where the tensor ``name`` of
    ``shape`` is a router or expert weight the config's experts do not have: an expert
    index past ``num_experts``, a router of another expert count, an expert of another
    width."""
    match = _EXPERT_WEIGHT.match(name)
    if match is None:
        return
    layer, expert, projection = match.groups()
    hidden, width, count = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    if not cfg.layer_is_moe(int(layer)):
        raise ModelLoadError(f"{name}: layer {layer} has a dense MLP in the config, but the "
                             "checkpoint gives it experts")
    if expert is None:
        expected, what = (count, hidden), f"num_experts = {count}, hidden_size = {hidden}"
    elif int(expert) >= count:
        raise ModelLoadError(f"{name}: expert {expert} of layer {layer}, but the config has "
                             f"num_experts = {count}")
    elif projection == "down_proj":
        expected, what = (hidden, width), f"hidden_size = {hidden}, expert width {width}"
    else:
        expected, what = (width, hidden), f"expert width {width}, hidden_size = {hidden}"
    if tuple(shape) != expected:
        raise ModelLoadError(f"{name} has shape {tuple(shape)}, but the config ({what}) "
                             f"gives {expected}")
