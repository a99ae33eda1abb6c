"""The encoder cache's bookkeeping (vLLM V1's ``v1/core/encoder_cache_manager.py``).

A vision model's encoder turns an image into as many embeddings as its placeholder has
tokens.  They are computed once per image, on the step whose chunk of the prompt first
reaches the placeholder, and kept until no request needs them: a chunked prefill that
splits an image's placeholder over several steps reads the rest from the cache, and a
request with an image another request already sent (the same ``mm_hash``) reads it too.

The cache has its own budget, ``encoder_cache_size`` embeddings, apart from the KV
cache's blocks.  A request is admitted only when its images fit (those already cached
count nothing); it holds them until it finishes, is aborted or is preempted by
recompute.  An image no request holds stays cached (*freeable*) until the space is
needed, then the least recently released goes first: the same image sent again later
is still a hit.  The scheduler decides; the model runner holds the tensors, and drops
the ones named in each step's ``free_encoder_mm_hashes``.

Standard library only.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    """Which images' embeddings the model runner holds, who needs them, and the room left."""

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size  # embeddings no entry takes
        self.sizes: dict[str, int] = {}  # every cached mm_hash -> its embeddings
        self.holders: dict[str, set[str]] = {}  # mm_hash -> requests holding it
        self.freeable: OrderedDict[str, None] = OrderedDict()  # held by none, oldest first
        self.computed: set[str] = set()  # the runner has them (or gets them this step)
        self.held_by: dict[str, list[str]] = {}  # request id -> the hashes it holds
        self.freed: list[str] = []  # evicted since the last step, for the runner to drop
        self.num_lookups = 0  # images of admitted requests ...
        self.num_hits = 0  # ... found cached

    def check_fits(self, features) -> None:
        """Refuse (``ValueError``) a request whose images could never be cached at once."""
        needed = sum(self._distinct(features).values())
        if needed > self.cache_size:
            raise ValueError(
                f"the prompt's images need {needed} encoder embeddings, more than "
                f"encoder_cache_size={self.cache_size}"
            )

    def can_allocate(self, features) -> bool:
        """Can every image of a waiting request be cached now (evicting freeable ones)?"""
        missing = sum(n for h, n in self._distinct(features).items() if h not in self.sizes)
        return missing <= self.num_free_slots + sum(self.sizes[h] for h in self.freeable)

    def acquire(self, request_id: str, features) -> None:
        """``request_id`` holds its images from now on: each a hit, or a new entry."""
        distinct = self._distinct(features)
        for h, n in distinct.items():
            self.num_lookups += 1
            if h in self.sizes:
                self.num_hits += 1
                self.freeable.pop(h, None)
            else:
                self._make_room(n)
                self.sizes[h], self.num_free_slots = n, self.num_free_slots - n
                self.holders[h] = set()
            self.holders[h].add(request_id)
        self.held_by[request_id] = list(distinct)

    def release(self, request_id: str) -> None:
        """``request_id`` no longer needs its images (finished, aborted, recomputed)."""
        for h in self.held_by.pop(request_id, ()):
            self.holders[h].discard(request_id)
            if not self.holders[h]:
                self.freeable[h] = None

    def is_computed(self, mm_hash: str) -> bool:
        """Whether the runner has its embeddings (or gets them this step)."""
        return mm_hash in self.computed

    def needs_compute(self, mm_hash: str) -> bool:
        """True once per cached image: whether its embeddings must be computed now."""
        if mm_hash in self.computed:
            return False
        self.computed.add(mm_hash)
        return True

    def get_freed_mm_hashes(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_lookups if self.num_lookups else 0.0

    def _make_room(self, n: int) -> None:
        while self.num_free_slots < n:
            h, _ = self.freeable.popitem(last=False)
            self.num_free_slots += self.sizes.pop(h)
            del self.holders[h]
            if h in self.computed:
                self.computed.discard(h)
                self.freed.append(h)

    @staticmethod
    def _distinct(features) -> dict[str, int]:
        """Each image's hash and size, once per distinct image of the prompt."""
        return {f.identifier: f.num_embeds for f in features}
