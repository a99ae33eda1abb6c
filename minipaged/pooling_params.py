"""What a pooling request asks for: vLLM's ``PoolingParams`` and ``PoolerConfig``.

A pooling model (``LLM(model, runner="pooling")``) runs a prompt once and returns one
vector for it, an embedding, instead of generating tokens.  `PoolerConfig` is the
engine's choice of how a prompt's hidden states become that vector (vLLM's
``--pooler-config``); `PoolingParams` is what one request may change of it.  Both check
their arguments on construction and raise ``ValueError`` naming the bad one.

Standard library only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from minipaged.sampling_params import RequestOutputKind

# vLLM's PoolingType names that minipaged runs: the last token's hidden state (a
# decoder's, such as E5-Mistral's), the mean over the prompt, the first token's (BERT's
# [CLS]).
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    """How the engine pools (vLLM's ``PoolerConfig``, ``--pooler-config``).

    Args:
        pooling_type: ``"LAST"`` (the default, a decoder's), ``"MEAN"`` or ``"CLS"``.
        normalize: scale each embedding to unit L2 norm, unless a request says otherwise.
    """

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}"
            )
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")

    @classmethod
    def from_value(cls, value) -> PoolerConfig:
        """vLLM's forms: None (the defaults), a dict of its keys, or a `PoolerConfig`;
        a key vLLM has that minipaged does not run is a ``ValueError``."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a dict or None, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(value) - known):
            raise ValueError(
                f"pooler_config key {unknown[0]!r} is not supported by minipaged; "
                f"it takes {sorted(known)}"
            )
        return cls(**value)


@dataclass
class PoolingParams:
    """One pooling request's options (vLLM's ``PoolingParams``).

    Args:
        dimensions: keep only the first ``dimensions`` numbers of the embedding
            (Matryoshka representation learning, Kusupati et al. 2022), before
            normalizing; only for a model whose config declares ``is_matryoshka`` or
            ``matryoshka_dimensions`` (`minipaged.models.pooler.Pooler.check`).
        normalize: scale the embedding to unit L2 norm; None: the `PoolerConfig`'s.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    # One embedding when the prompt is done: one sequence, nothing generated, so no
    # blocks beyond the prompt's; a single output.
    n: ClassVar[int] = 1
    max_tokens: ClassVar[int] = 0
    output_kind: ClassVar[RequestOutputKind] = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int)
            or isinstance(self.dimensions, bool)
            or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be an int >= 1 or None, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool or None, got {self.normalize!r}")
