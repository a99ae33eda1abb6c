"""The pooler: a prompt's hidden states made one embedding (vLLM's
``model_executor/layers/pooler.py``).

A pooling model runs each prompt once, as a prefill, and keeps no decode: the final
hidden states (after the last norm, where a generative model would project to logits)
are pooled into one vector per prompt:

- ``LAST``: the last prompt token's (a decoder's, which has seen the whole prompt:
  E5-Mistral, GTE-Qwen);
- ``MEAN``: the mean over every prompt token (sentence-transformers' default);
- ``CLS``: the first token's (BERT's ``[CLS]``).

Then, as a request asks (`PoolingParams`): the first ``dimensions`` numbers only
(Matryoshka embeddings), and unit L2 norm.

With chunked prefill a long prompt's hidden states arrive chunk by chunk, so the pooler
keeps a running state per request (`SequenceGroup.pooled`): LAST keeps the last chunk's
last row, MEAN a running sum, CLS the first row.  ``num_pooled`` counts the prompt
positions already folded in: a prompt re-run after a recompute preemption folds none
twice.  MEAN and CLS need every position they pool computed, so their requests do not
read the prefix cache (`SequenceGroup.reads_prefix_cache`); LAST's last token always runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minipaged.pooling_params import PoolerConfig, PoolingParams
from minipaged.sequence import SequenceGroup


class Pooler:
    """The engine's pooling (``pooler_config``) over a model of ``hidden_size`` whose
    config may declare Matryoshka dimensions."""

    def __init__(self, config: PoolerConfig, model_config) -> None:
        self.config = config
        self.hidden_size = model_config.hidden_size
        dims = getattr(model_config, "matryoshka_dimensions", None)
        self.matryoshka_dimensions = list(dims) if dims else None
        # vLLM's ModelConfig.is_matryoshka.
        self.is_matryoshka = bool(dims) or bool(getattr(model_config, "is_matryoshka", False))

    def check(self, params: PoolingParams) -> None:
        """Refuse (``ValueError``) ``dimensions`` the model was not trained for, as vLLM
        does: only a Matryoshka model's embedding can be cut short."""
        dims = params.dimensions
        if dims is None:
            return
        if not self.is_matryoshka:
            raise ValueError(
                f"dimensions={dims}: the model does not support matryoshka "
                "representation (its config declares neither is_matryoshka nor "
                "matryoshka_dimensions); changing output dimensions would give poor results"
            )
        if self.matryoshka_dimensions is not None and dims not in self.matryoshka_dimensions:
            raise ValueError(
                f"dimensions={dims}: the model supports only matryoshka dimensions "
                f"{self.matryoshka_dimensions}"
            )
        if dims > self.hidden_size:
            raise ValueError(f"dimensions={dims} is more than the model's {self.hidden_size}")

    def add(self, group: SequenceGroup, start: int, hidden: torch.Tensor) -> None:
        """Fold the hidden states of ``group``'s prompt positions ``[start, start +
        len(hidden))``, run this step, into its pooled state; once the prompt's last
        position is in, set its ``embedding``."""
        end = start + len(hidden)
        first = max(start, group.num_pooled)  # positions a recompute runs again: done
        if first >= end:
            return
        kind, prompt_len = self.config.pooling_type, len(group.prompt_token_ids)
        if kind == "MEAN":
            part = hidden[first - start :].float().sum(0)
            group.pooled = part if group.pooled is None else group.pooled + part
        elif kind == "CLS" and first == 0:
            group.pooled = hidden[0].float()
        elif kind == "LAST" and end == prompt_len:
            group.pooled = hidden[-1].float()
        group.num_pooled = end
        if end == prompt_len:
            group.embedding = self.finish(group.pooled, prompt_len, group.params).tolist()

    def finish(self, pooled: torch.Tensor, prompt_len: int, params: PoolingParams) -> torch.Tensor:
        """The embedding of a prompt's pooled state: the mean's division, the
        Matryoshka cut, the normalization (in that order, as vLLM's pooler head)."""
        vector = pooled / prompt_len if self.config.pooling_type == "MEAN" else pooled
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        return F.normalize(vector, p=2, dim=-1) if normalize else vector
