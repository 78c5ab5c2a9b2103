"""A draft that reads the target's hidden states (EAGLE-style).

A small draft made of the target's first layers knows little of the prompt: facts and
plans live in the target's deeper layers. This draft instead takes, at each position j,
the token x_j *and the target's final hidden state at position j-1* (the vector the
target's LM head reads), and predicts the target's hidden state at j; the target's LM
head turns that into q(x_{j+1}). Within a drafted block the target has not run yet, so
the draft feeds back its own predicted hidden states; once the target has scored the
block, the engine re-feeds the kept tokens with the target's true hidden states.

The module is a few decoder layers of the target's architecture behind a linear map of
[embedding(x_j), h_{j-1}], sharing the target's embeddings, rotary embedding and LM head.
It can start from a trained layer draft (``smcsd distill --kind features --init-draft``):
the map starts by ignoring the states, so training begins from that draft's quality.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import transformers
from torch import nn

from .layers import trainable_copy


class FeatureDraft(nn.Module):
    """Decoder layers over [token embedding, target hidden state]; predicts the next hidden state.

    Args:
        body: a few-layer model of the target's class sharing its embeddings and LM head.
        fc: ``Linear(2 * hidden, hidden)`` joining a token's embedding and a hidden state.
    """

    reads_hidden = True  # backends feed the target's hidden states with every token

    def __init__(self, body: transformers.PreTrainedModel, fc: nn.Linear) -> None:
        super().__init__()
        self.body, self.fc = body, fc
        self.config = body.config
        self.generation_config = body.generation_config

    @property
    def device(self) -> torch.device:
        """Where the draft's own weights are."""
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the draft's own weights."""
        return self.fc.weight.dtype

    def get_output_embeddings(self) -> nn.Module:
        """The target's LM head (shared)."""
        return self.body.get_output_embeddings()

    def predict_hidden(self, input_ids: torch.Tensor, hidden: torch.Tensor, **kwargs) -> torch.Tensor:
        """The target's hidden states ``[B, T, H]`` predicted from tokens ``[B, T]`` and the states before.

        ``hidden [B, T, H]`` holds, at position j, the target's hidden state at j - 1.
        ``kwargs`` go to the decoder (attention mask, position ids, cache).
        """
        embeds = self.body.model.embed_tokens(input_ids)
        joined = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], -1))
        return self.body.model(inputs_embeds=joined, **kwargs).last_hidden_state

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, **kwargs) -> torch.Tensor:
        """Next-token logits ``[B, T, V]``."""
        return self.get_output_embeddings()(self.predict_hidden(input_ids, hidden, **kwargs))


def final_hidden(
    model: transformers.PreTrainedModel, ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs
) -> torch.Tensor:
    """A model's hidden states (the final ones, what its LM head reads) ``[B, T, H]``."""
    return model.get_decoder()(input_ids=ids, attention_mask=attention_mask, **kwargs).last_hidden_state


def feature_student(target: transformers.PreTrainedModel, source_layers: Sequence[int]) -> FeatureDraft:
    """A trainable feature draft: fp32 copies of target layers ``source_layers`` and the final norm.

    The input map starts as [identity, 0]: the draft first reads only its tokens, exactly
    like a layer draft of the same layers, and training teaches it to use the states.
    """
    body = trainable_copy(target, source_layers)
    size = target.config.hidden_size
    fc = nn.Linear(2 * size, size, bias=False, device=target.device)
    with torch.no_grad():
        fc.weight.zero_()
        fc.weight[:, :size] = torch.eye(size)
    fc.requires_grad_(True)
    return FeatureDraft(body, fc)


def own_modules(draft: FeatureDraft) -> dict[str, nn.Module]:
    """The modules a feature draft owns (saved and trained); the rest is the target's."""
    return {"fc": draft.fc, "layers": draft.body.model.layers, "norm": draft.body.model.norm}
