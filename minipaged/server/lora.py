"""The LoRA adapters a server offers, by name (vLLM's ``--lora-modules`` and its
``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``).

A request's ``model`` field picks what serves it: the base model's name, or an
adapter's, which runs the request with that adapter (`minipaged.lora_request`).
``/v1/models`` lists the adapters beside the base model, each with the base as its
``parent``.  An adapter is read by the engine when it is loaded (`EngineClient.add_lora`),
so a malformed directory is refused then (400, naming the file), not at its first
request; ids are never reused, so an adapter unloaded and loaded again is a new adapter
to the engine.
"""

from __future__ import annotations

import itertools

from minipaged.engine.protocol import EngineClient
from minipaged.lora_request import LoRARequest


class UnknownAdapterError(LookupError):
    """No model or adapter of that name is served (404)."""


class ServedAdapters:
    """Adapters by name over ``engine`` (built with ``enable_lora``, or not: then every
    load is refused)."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.by_name: dict[str, LoRARequest] = {}
        self._loading: set[str] = set()  # names whose adapter the engine is reading
        self._ids = itertools.count(1)

    async def load_modules(self, modules: list[str], base_name: str) -> None:
        """Load ``--lora-modules name=path ...``, in order."""
        for name, path in self.parse_modules(modules):
            await self.load(name, path, base_name)

    def parse_modules(self, modules: list[str]) -> list[tuple[str, str]]:
        """``--lora-modules name=path ...`` as ``(name, path)`` pairs."""
        pairs = []
        for module in modules:
            name, sep, path = module.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules takes name=path, got {module!r}")
            pairs.append((name, path))
        return pairs

    async def load(self, name: str, path: str, base_name: str) -> LoRARequest:
        """Have the engine read an adapter, then offer it; ``ValueError`` naming what
        is wrong (the file)."""
        if not self.engine.facts.config.enable_lora:
            raise ValueError("loading a LoRA adapter needs a server started with --enable-lora")
        if name in self.by_name or name in self._loading or name == base_name:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        lora_request = LoRARequest(name, next(self._ids), path)
        self._loading.add(name)
        try:
            await self.engine.add_lora(lora_request)
        finally:
            self._loading.discard(name)
        self.by_name[name] = lora_request
        return lora_request

    def unload(self, name: str) -> LoRARequest:
        try:
            return self.by_name.pop(name)
        except KeyError:
            raise UnknownAdapterError(f"The lora adapter '{name}' cannot be found.") from None

    def resolve(self, model: str | None, base_name: str) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model."""
        if model is None or model == base_name:
            return None
        if model in self.by_name:
            return self.by_name[model]
        raise UnknownAdapterError(f"The model `{model}` does not exist.")

    def cards(self, base_name: str, created: int) -> list[dict]:
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "minipaged",
                "root": lora_request.lora_path,
                "parent": base_name,
            }
            for name, lora_request in self.by_name.items()
        ]
