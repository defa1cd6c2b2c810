"""The client's layers in a fine-tuning session: the token embeddings, the final norm and the LM head, frozen or
trained whole (LoraSpec.edges, peft's modules_to_save; sharding/lora_edges.py).

A trained edge is a float32 copy on the client's device with its own AdamW (the session's settings), stepped with the
nodes' slices: AdamW is elementwise, so the edges and the slices end where one process training all of them ends. The
head and the norm get their gradients from the loss; the embeddings from the gradient of the chain's input, which the
first node returns with its backward pass. Untrained edges are the model's own (frozen) layers.

    layers = EdgeLayers(model.edges, model.model_config, spec.edges, settings, initial_state)
    hidden = layers.embed(input_ids)               # with its autograd graph when the embeddings train
    loss, grad = layers.loss_and_grad(output, labels, total)
    layers.embed_backward(hidden, grad_of_input)   # the first node's answer
    layers.step()                                   # once per optimizer step
    state = layers.state(step)                      # EdgeState for a checkpoint; layers.restore(state) goes back
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from nesa_node.client.train_link import OptimizerSettings, causal_lm_loss
from nesa_node.sharding.client_edges import ClientEdges
from nesa_node.sharding.lora_edges import EdgeState, check_edge_state, check_edge_weights

MOMENTS = ("exp_avg", "exp_avg_sq")


def edge_weights_of(edges: ClientEdges, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The current weights of the client's layers `names` (float32 copies on the CPU): where new edges start."""
    modules = {"embed_tokens": edges.embed_tokens, "norm": edges.norm, "lm_head": edges.lm_head}
    return {name: modules[name].weight.detach().float().cpu().clone() for name in names}


def with_edge_weights(edges: ClientEdges, weights: dict[str, torch.Tensor]) -> ClientEdges:
    """A copy of the client's layers with `weights` (an adapter's trained edges) in their dtype and device; the LM
    head gets a weight of its own even where the model ties it to the embeddings."""
    modules = {"embed_tokens": edges.embed_tokens, "norm": edges.norm, "lm_head": edges.lm_head}
    copies = {}
    for name, module in modules.items():
        copies[name] = module
        if name in weights:  # a shallow copy with a parameter table of its own: the model's module is left alone
            copies[name] = copy.copy(module)
            copies[name]._parameters = module._parameters.copy()
            like = module.weight
            copies[name].weight = nn.Parameter(weights[name].to(like.device, like.dtype), requires_grad=False)
    return ClientEdges(copies["embed_tokens"], copies["norm"], copies["lm_head"]).eval()


class EdgeLayers:
    """Embeddings, final norm and LM head of a fine-tuning session: those in `names` trained (module docstring)."""

    def __init__(
        self, edges: ClientEdges, model_config, names: tuple[str, ...], settings: OptimizerSettings, state: EdgeState
    ):
        self.frozen = edges
        self.model_config = model_config
        self.names = names
        pad = getattr(model_config, "pad_token_id", None)  # its row gets no gradient, as in nn.Embedding
        self.padding_idx = pad if isinstance(pad, int) and 0 <= pad < model_config.vocab_size else None
        check_edge_weights(state.weights, names, model_config, "edge state")
        device = edges.embed_tokens.weight.device
        with torch.inference_mode(False):
            self.params = {name: nn.Parameter(state.weights[name].to(device, torch.float32).clone()) for name in names}
            self.norm = edges.norm
            if "norm" in names:  # the model's norm module (its family's formula) with the trained weight
                self.norm = copy.deepcopy(edges.norm).float()
                self.norm.weight = self.params["norm"]
        self.optimizer = (
            torch.optim.AdamW(
                list(self.params.values()),
                lr=settings.lr,
                betas=settings.betas,
                eps=settings.eps,
                weight_decay=settings.weight_decay,
                foreach=False,
            )
            if names
            else None
        )
        self.restore(state)

    @property
    def trains(self) -> bool:
        return bool(self.names)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.trains else self.frozen.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.frozen.embed_tokens.weight.device

    # ---- passes ----------------------------------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor, grad: bool = True) -> torch.Tensor:
        """Hidden states of `input_ids` (float32, on the client's device); with `grad` and trained embeddings, with
        their autograd graph (embed_backward then takes the gradient of the chain's input)."""
        weight = self.params.get("embed_tokens")
        if weight is not None and not grad:
            with torch.inference_mode():
                return nn.functional.embedding(input_ids.to(self.device), weight, padding_idx=self.padding_idx)
        if weight is None:
            with torch.inference_mode():
                return self.frozen.embed_tokens(input_ids.to(self.device)).float()
        with torch.enable_grad():
            return nn.functional.embedding(input_ids.to(self.device), weight, padding_idx=self.padding_idx)

    def embed_backward(self, hidden: torch.Tensor, grad: torch.Tensor) -> None:
        """The gradient of the chain's input into the embeddings (nothing when they are frozen)."""
        if hidden.requires_grad:
            hidden.backward(grad.to(hidden.device, hidden.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.params.get("lm_head")
        normed = self.norm(hidden)
        return nn.functional.linear(normed, head) if head is not None else self.frozen.lm_head(normed)

    def loss_and_grad(
        self, output: torch.Tensor, labels: torch.Tensor, total: int | None
    ) -> tuple[float, torch.Tensor]:
        """The loss of the chain's output and its gradient (on the CPU, for the last node); the trained head and
        norm gather theirs."""
        with torch.enable_grad():
            hidden = output.to(self.device, self.dtype).detach().requires_grad_(True)
            loss = causal_lm_loss(self.logits(hidden), labels, total=total)
            loss.backward()
        return loss.item(), hidden.grad.float().cpu()

    def loss(self, output: torch.Tensor, labels: torch.Tensor, total: int | None) -> float:
        with torch.inference_mode():
            return causal_lm_loss(self.logits(output.to(self.device, self.dtype)), labels, total=total).item()

    def step(self) -> None:
        """AdamW's step on the trained edges with the gradients gathered since the last one."""
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    # ---- state -----------------------------------------------------------------------------------------------------

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: parameter.detach().cpu().clone() for name, parameter in self.params.items()}

    def state(self, step: int) -> EdgeState:
        """The trained edges and AdamW's moments now (copies), as of optimizer step `step`."""
        moments = {}
        for name, parameter in self.params.items():
            saved = self.optimizer.state.get(parameter)
            for moment in MOMENTS if saved else ():
                moments[f"{name}.{moment}"] = saved[moment].detach().cpu().clone()
        return EdgeState(step, self.weights(), moments)

    def restore(self, state: EdgeState) -> None:
        """Go back to `state` (weights and moments; gathered gradients dropped); AdapterError when it is not of these
        edges and this model."""
        check_edge_state(state, self.names, self.model_config, "edge state")
        if self.optimizer is None:
            return
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()
        with torch.no_grad():
            for name, parameter in self.params.items():
                parameter.copy_(state.weights[name])
                if state.moments:
                    self.optimizer.state[parameter] = {
                        "step": torch.tensor(float(state.step)),
                        **{
                            moment: state.moments[f"{name}.{moment}"].to(parameter.device, torch.float32).clone()
                            for moment in MOMENTS
                        },
                    }


__all__ = ["EdgeLayers", "edge_weights_of", "with_edge_weights"]
