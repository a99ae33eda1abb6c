"""The KV cache manager: every sequence's block table over a GPU and a CPU pool (paper §4.2–4.5).

This is the memory layer's front door.  The scheduler asks it whether a sequence's
next tokens fit, gives them slots, forks sequences (parallel sampling, beam search),
frees them, and swaps whole sequence groups between the GPU pool and the CPU pool.
Every answer is *data* (slot mappings, ``(src, dst)`` block copies, swap mappings):
the cache engine, which owns the tensors, carries them out.

The contract with the engine, per step:

1. Execute the step's block operations in this order: swap-outs, swap-ins, copy-on-write
   copies, then the forward pass.  A swap-out frees its GPU blocks at once and a later
   call in the same step may hand them out again, so their contents must leave first.
2. Every slot handed out is written in the same step.  With prefix caching a block is
   findable as soon as it is full (as in vLLM), so another sequence scheduled in the
   same step may reuse it; that is safe because each layer writes all new keys and
   values before any attention reads them.  Preempt or abort only between steps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .allocator import BlockAllocator, NoFreeBlocksError
from .block_table import BlockCopy, BlockTable, blocks_for
from .prefix_cache import PrefixCachingBlockAllocator

# A token async scheduling runs before it is sampled (`KVCacheManager.append_placeholder`).
PLACEHOLDER_TOKEN_ID = -1


@dataclass(slots=True)
class Allocation:
    """What the cache engine and the model runner need to run a sequence's new tokens."""

    slot_mapping: list[int]
    block_table: list[int]  # the sequence's physical blocks after this allocation
    copies: list[BlockCopy] = field(default_factory=list)
    num_cached_tokens: int = 0


class KVCacheManager:
    """Block tables of all sequences, keyed by sequence id."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = False,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.gpu: BlockAllocator = (
            PrefixCachingBlockAllocator(num_gpu_blocks, block_size, "gpu")
            if enable_prefix_caching
            else BlockAllocator(num_gpu_blocks, "gpu")
        )
        self.cpu = BlockAllocator(num_cpu_blocks, "cpu")
        self.tables: dict[str, BlockTable] = {}
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    @property
    def num_gpu_blocks(self) -> int:
        return self.gpu.num_blocks

    @property
    def num_free_gpu_blocks(self) -> int:
        """Blocks the GPU pool can hand out now (with prefix caching, evictable ones too)."""
        return self.gpu.num_free_blocks

    @property
    def prefix_caching(self) -> bool:
        return isinstance(self.gpu, PrefixCachingBlockAllocator)

    def _table(self, seq_id: str) -> BlockTable:
        try:
            return self.tables[seq_id]
        except KeyError:
            raise ValueError(f"seq_id {seq_id!r} has no block table") from None

    def has_block_table(self, seq_id: str) -> bool:
        return seq_id in self.tables

    def block_table(self, seq_id: str) -> list[int]:
        return list(self._table(seq_id).blocks)

    def live_block_table(self, seq_id: str) -> list[int]:
        """The sequence's block table itself, uncopied: read it, never keep or change it
        (the scheduler's per-step read, which a copy would make O(blocks))."""
        return self.tables[seq_id].blocks

    def num_tokens(self, seq_id: str) -> int:
        return self._table(seq_id).num_tokens

    def is_swapped(self, seq_id: str) -> bool:
        return self._table(seq_id).allocator is self.cpu

    # -- admission and growth ---------------------------------------------------------
    # ``extra_key``: what besides its tokens sets a prompt's KV apart, the request's LoRA
    # adapter (None: the base model); the prefix cache shares blocks only under one key.
    def num_cached_tokens(
        self, prompt_token_ids: list[int], extra_key=None, use_cache: bool = True
    ) -> int:
        """How many leading prompt tokens the prefix cache could serve (read-only).
        ``use_cache=False`` (a sequence that must compute its whole prompt) reads none."""
        if not (self.prefix_caching and use_cache):
            return 0
        return len(self.gpu.match_prefix(prompt_token_ids, extra_key)) * self.block_size

    def can_allocate(self, prompt_token_ids: list[int], num_new_tokens: int | None = None) -> bool:
        """Would `allocate()` find the blocks it needs right now?"""
        return self.blocks_to_allocate(prompt_token_ids, num_new_tokens) <= self.gpu.num_free_blocks

    def blocks_to_allocate(
        self,
        prompt_token_ids: list[int],
        num_new_tokens: int | None = None,
        extra_key=None,
        use_cache: bool = True,
    ) -> int:
        """Free blocks `allocate()` would take (a scheduler sums them over a group)."""
        entries, end = self._plan(prompt_token_ids, num_new_tokens, extra_key, use_cache)
        return self._blocks_needed(entries, end - len(entries) * self.block_size)

    def allocate(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        num_new_tokens: int | None = None,
        extra_key=None,
        use_cache: bool = True,
    ) -> Allocation:
        """Start a sequence: reuse its cached prefix, then give slots to the next tokens.

        ``num_new_tokens`` (default: the rest of the prompt) lets chunked prefill take a
        prompt in pieces; later pieces go through `append()`.  ``use_cache=False``
        reuses nothing (its full blocks still join the cache).  All or nothing.
        """
        if seq_id in self.tables:
            raise ValueError(f"seq_id {seq_id!r} already has a block table")
        entries, end = self._plan(prompt_token_ids, num_new_tokens, extra_key, use_cache)
        cached = len(entries) * self.block_size
        needed = self._blocks_needed(entries, end - cached)
        if needed > self.gpu.num_free_blocks:
            raise NoFreeBlocksError(
                f"starting {seq_id!r} needs {needed} blocks, {self.gpu.num_free_blocks} free"
            )
        table = BlockTable(self.block_size, self.gpu, extra_key)
        if entries:
            table.adopt_cached_prefix(entries)
        slots, copies = table.append_tokens(prompt_token_ids[cached:end])
        if self.prefix_caching and use_cache:
            self.gpu.record_lookup(len(prompt_token_ids), cached)
        self.tables[seq_id] = table
        return Allocation(slots, list(table.blocks), copies, cached)

    def _plan(
        self,
        prompt_token_ids: list[int],
        num_new_tokens: int | None,
        extra_key=None,
        use_cache: bool = True,
    ):
        """The cached prefix a new sequence would reuse, and where its first chunk ends."""
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        reads = self.prefix_caching and use_cache
        entries = self.gpu.match_prefix(prompt_token_ids, extra_key) if reads else []
        cached = len(entries) * self.block_size
        if num_new_tokens is None:
            return entries, len(prompt_token_ids)
        limit = len(prompt_token_ids) - cached
        # The type too, before anything changes: a float would fail mid-allocation.
        if not isinstance(num_new_tokens, int) or not 1 <= num_new_tokens <= limit:
            raise ValueError(
                f"num_new_tokens must be an int in [1, {limit}] "
                f"({cached} prompt tokens are cached), got {num_new_tokens!r}"
            )
        return entries, cached + num_new_tokens

    def _blocks_needed(self, entries: list, num_new_tokens: int) -> int:
        # A cached block that is only evictable counts as free but is reused in place,
        # so it cannot also be handed out as a fresh block.
        revived = sum(self.gpu.ref_count(e.block) == 0 for e in entries)
        return blocks_for(num_new_tokens, self.block_size) + revived

    def can_allocate_all(
        self, prompts: list[tuple[list[int], int]], extra_key=None, use_cache: bool = True
    ) -> bool:
        """Would `allocate()` find the blocks for every ``(prompt_token_ids,
        num_new_tokens)`` of ``prompts`` (a request's sequences, admitted together, under
        one ``extra_key`` and ``use_cache``)?"""
        need = sum(
            self.blocks_to_allocate(tokens, n, extra_key, use_cache) for tokens, n in prompts
        )
        return need <= self.gpu.num_free_blocks

    def can_append(self, seq_id: str, num_new_tokens: int = 1) -> bool:
        """Would `append()` succeed now?  Never for a swapped-out sequence."""
        table = self._table(seq_id)
        if table.allocator is not self.gpu:
            return False
        return table.num_blocks_needed(num_new_tokens) <= self.gpu.num_free_blocks

    def can_append_slot(self, seq_id: str) -> bool:
        """`can_append` of one token to a running sequence (`append_slot`), kept lean
        for the decode's common case: any free block will do."""
        return self.gpu.num_free_blocks > 0 or self.tables[seq_id].num_blocks_needed(1) == 0

    def blocks_to_append(self, seq_id: str, num_new_tokens: int = 1) -> int:
        """Free blocks `append()` would take, copy-on-write included (alone: see
        `can_append_all` for sequences that share blocks)."""
        return self._table(seq_id).num_blocks_needed(num_new_tokens)

    def can_append_any(self, num_seqs: int, num_new_tokens: int) -> bool:
        """Could any ``num_seqs`` running sequences take ``num_new_tokens`` new tokens
        between them, whatever their tables?  Each takes at most one block for its first
        token (a fresh one, or a copy of a shared last block) and one per ``block_size``
        tokens after it.  Cheap: a scheduler asks it first, every step."""
        worst = 2 * num_seqs + blocks_for(num_new_tokens, self.block_size)
        return worst <= self.gpu.num_free_blocks

    def can_append_all(self, appends: list[tuple[str, int]]) -> bool:
        """Would `append()` succeed for every ``(seq_id, num_new_tokens)`` of
        ``appends``, one after the other?  The copy-on-write rule for sequences that
        share a partial last block (forks): each sharer that writes first copies it, but
        the last one to write keeps the block, so a block held only by sequences of
        ``appends`` costs one copy fewer than its holders."""
        free = self.gpu.num_free_blocks
        # A cheap upper bound settles most steps: n tokens take at most one block for
        # the first and blocks_for(n - 1) fresh blocks for the rest.
        if len(appends) + sum(blocks_for(n - 1, self.block_size) for _, n in appends) <= free:
            return True
        tables = [(self._table(seq_id), n) for seq_id, n in appends]
        need = sum(table.num_blocks_needed(n) for table, n in tables)
        lasts = Counter(
            table.blocks[-1] for table, n in tables if n and table.num_tokens % self.block_size
        )
        need -= sum(k > 1 and self.gpu.ref_count(b) == k for b, k in lasts.items())
        return need <= free

    def append(
        self, seq_id: str, token_ids: list[int], num_lookahead: int = 0, live: bool = False
    ) -> Allocation:
        """Slots for a running sequence's next tokens (a decode token or a prefill chunk);
        the last ``num_lookahead`` are a draft's guesses, kept until `rollback`.  With
        ``live``, the allocation's block table is `live_block_table` (uncopied)."""
        table = self._table(seq_id)
        if table.allocator is not self.gpu:
            raise ValueError(f"seq_id {seq_id!r} is swapped out; swap it in first")
        if not isinstance(num_lookahead, int) or not 0 <= num_lookahead < max(len(token_ids), 1):
            raise ValueError(
                f"num_lookahead must be an int in [0, {len(token_ids)}), got {num_lookahead!r}"
            )
        slots, copies = table.append_tokens(token_ids, num_lookahead)
        return Allocation(slots, table.blocks if live else list(table.blocks), copies)

    def append_slot(
        self, seq_id: str, token_id: int
    ) -> tuple[int, list[BlockCopy], list[int], int]:
        """`append` of one token (a decode): the token's slot, any copy-on-write copy,
        the sequence's block table (`live_block_table`) and how many of its leading
        blocks the append left as they were (all but a new or copied last one).  The
        scheduler takes the common case, a slot from the table's ``room``, inline
        (`BlockTable.take_slot`) and calls this for the rest."""
        table = self.tables[seq_id]
        if table.allocator is not self.gpu:
            raise ValueError(f"seq_id {seq_id!r} is swapped out; swap it in first")
        num_blocks = len(table.blocks)
        slots, copies = table.append_tokens([token_id])
        return slots[0], copies, table.blocks, num_blocks - len(copies)

    def append_placeholder(self, seq_id: str) -> tuple[int, list[BlockCopy], list[int], int]:
        """`append_slot` of a token not sampled yet (async scheduling, vLLM's
        ``num_output_placeholders``): its slot is taken now, its block reaches the
        prefix cache only once `fill_placeholder` gives the token."""
        table = self.tables[seq_id]
        num_blocks = len(table.blocks)
        slots, copies = table.append_tokens([PLACEHOLDER_TOKEN_ID], num_lookahead=1)
        return slots[0], copies, table.blocks, num_blocks - len(copies)

    def fill_placeholder(self, seq_id: str, token_id: int) -> None:
        """The placeholder `append_placeholder` put last in ``seq_id``'s table is
        ``token_id``."""
        self.tables[seq_id].fill_placeholder(token_id)

    def rollback(self, seq_id: str, num_tokens: int) -> int:
        """Keep the first ``num_tokens`` of a running sequence's tokens, giving back the
        slots of the rest (a draft's rejected guesses); returns the blocks released."""
        table = self._table(seq_id)
        if table.allocator is not self.gpu:
            raise ValueError(f"seq_id {seq_id!r} is swapped out; only a running one rolls back")
        return table.truncate(num_tokens)

    # -- sharing and freeing ----------------------------------------------------------
    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares all of the parent's blocks, copy-on-write (§4.4)."""
        if child_id in self.tables:
            raise ValueError(f"child_id {child_id!r} already has a block table")
        self.tables[child_id] = self._table(parent_id).fork()

    def uncache(self, blocks: set[int]) -> None:
        """Never serve ``blocks`` from the prefix cache (their contents are wrong)."""
        if self.prefix_caching:
            self.gpu.uncache_blocks(blocks)

    def free(self, seq_id: str) -> None:
        self._table(seq_id).free()
        del self.tables[seq_id]

    # -- swapping (§4.5): whole groups, all or nothing ---------------------------------
    def swap_out(self, seq_ids: list[str]) -> list[tuple[int, int]]:
        """Move a group's blocks to the CPU pool; returns ``(gpu_block, cpu_block)`` pairs."""
        mapping = self._swap(seq_ids, src=self.gpu, dst=self.cpu)
        self.num_swapped_out_blocks += len(mapping)
        return mapping

    def swap_in(self, seq_ids: list[str]) -> list[tuple[int, int]]:
        """Bring a swapped group back; returns ``(cpu_block, gpu_block)`` pairs."""
        mapping = self._swap(seq_ids, src=self.cpu, dst=self.gpu)
        self.num_swapped_in_blocks += len(mapping)
        return mapping

    def can_swap_in(self, seq_ids: list[str]) -> bool:
        return len(self._distinct_blocks(seq_ids, self.cpu)) <= self.gpu.num_free_blocks

    def can_swap_out(self, seq_ids: list[str]) -> bool:
        return len(self._distinct_blocks(seq_ids, self.gpu)) <= self.cpu.num_free_blocks

    def _distinct_blocks(self, seq_ids: list[str], pool: BlockAllocator) -> list[int]:
        tables = [self._table(s) for s in seq_ids]
        if any(t.allocator is not pool for t in tables):
            raise ValueError(f"every sequence in {seq_ids!r} must be in the {pool.device} pool")
        # A block shared inside the group moves once and stays shared.
        return list(dict.fromkeys(b for t in tables for b in t.blocks))

    def _swap(
        self, seq_ids: list[str], src: BlockAllocator, dst: BlockAllocator
    ) -> list[tuple[int, int]]:
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids has duplicates: {seq_ids!r}")
        blocks = self._distinct_blocks(seq_ids, src)
        if len(blocks) > dst.num_free_blocks:
            raise NoFreeBlocksError(
                f"swapping {len(blocks)} blocks to the {dst.device} pool, "
                f"{dst.num_free_blocks} free"
            )
        mapping = {b: dst.allocate() for b in blocks}
        for seq_id in seq_ids:
            table = self._table(seq_id)
            for block in reversed(table.blocks):
                src.free(block)
                dst.incref(mapping[block])
            table.remap(mapping, dst)
        for new_block in mapping.values():
            dst.free(new_block)  # drop the reference allocate() gave; the tables hold theirs
        return list(mapping.items())

    def usage(self) -> dict[str, int]:
        """Where the GPU pool's slots go right now (paper §3's accounting, for sharing):
        blocks held, blocks held by more than one sequence, slots holding a token (each
        block counted once, however many sequences share it) and reserved-but-empty slots."""
        filled: dict[int, int] = {}
        for table in self.tables.values():
            if table.allocator is not self.gpu:
                continue
            for i, block in enumerate(table.blocks):
                in_block = min(self.block_size, table.num_tokens - i * self.block_size)
                filled[block] = max(filled.get(block, 0), in_block)
        shared = sum(self.gpu.ref_count(b) > 1 for b in filled)
        tokens = sum(filled.values())
        return {
            "num_used_gpu_blocks": len(filled),
            "num_shared_gpu_blocks": shared,
            "num_kv_tokens": tokens,
            "num_wasted_slots": len(filled) * self.block_size - tokens,
        }

    def stats(self) -> dict[str, float]:
        hit_rate = self.gpu.hit_rate if self.prefix_caching else 0.0
        return {
            "num_gpu_blocks": self.gpu.num_blocks,
            "num_free_gpu_blocks": self.gpu.num_free_blocks,
            "num_cpu_blocks": self.cpu.num_blocks,
            "num_free_cpu_blocks": self.cpu.num_free_blocks,
            "num_cached_blocks": self.gpu.num_cached_blocks if self.prefix_caching else 0,
            "num_swapped_out_blocks": self.num_swapped_out_blocks,
            "num_swapped_in_blocks": self.num_swapped_in_blocks,
            "prefix_cache_hit_rate": hit_rate,
        }
