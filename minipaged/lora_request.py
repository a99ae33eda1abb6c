"""`LoRARequest`: which fine-tuned adapter a request runs with, with vLLM's names.

    from minipaged.lora_request import LoRARequest
    llm.generate(prompt, params, lora_request=LoRARequest("sql", 1, "adapters/sql"))

``lora_path`` is a directory in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``); ``lora_int_id`` names the adapter to the engine (its
slot, the prefix cache's key) and must be unique per adapter, ``>= 1``.

Standard library only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: its name (the server's ``model``), its id and its directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise ValueError(f"lora_path must be a str or a path, got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
