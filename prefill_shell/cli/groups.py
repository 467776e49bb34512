"""The command lines' runtime for any model ``--model`` names: one page table per row, KV groups or not.

``run`` (prefix sharing) and ``score`` (the scorer's block pool) plan one
page table per row over a pool of ``layout.num_blocks`` blocks. A plain
model runs those tables as they are. A hybrid model (Gemma 3, a windowed
Mistral, Qwen2 or Qwen3: ``reference.load_model_folder``) reads one table per
KV group, and its groups share KV buffers, so a block id serves one group
only (``prefill_core.group_rules``). So the pool holds ``groups x num_blocks``
blocks and group g's table is the row's table with every block id ``b``
moved to ``b + g * num_blocks``: the groups' ids never meet, and each call
passes them as ``group_page_tables`` (what ``PrefillExecutor.prefill``
takes). A command never frees a block a window left, so every column of
every group maps a written block and no null block is named.
"""

from __future__ import annotations

import attrs
import torch

from prefill_core import ExecutionMode, PageTableLayout, PrefillPolicy
from prefill_core.errors import PrefillConfigError
from prefill_shell.backends import TorchBackend
from prefill_shell.engine.config import PrefillRuntimeConfig
from prefill_shell.engine.executor import PrefillExecutor
from prefill_shell.engine.runtime import PrefillRuntime

__all__ = ["GroupTablesRuntime", "command_runtime", "group_tables"]


def group_tables(page_table, num_groups: int, blocks_per_group: int) -> list[torch.Tensor]:
    """Each group's table: ``page_table``'s block ids moved by ``g * blocks_per_group`` (negative filler kept)."""
    table = torch.as_tensor(page_table, dtype=torch.int32)
    return [torch.where(table >= 0, table + g * blocks_per_group, table) for g in range(num_groups)]


class GroupTablesRuntime:
    """A hybrid model's ``PrefillRuntime`` behind calls that give one page table per row.

    ``prepare`` and ``prefill`` take the command's table (block ids below
    ``blocks_per_group``) and pass each KV group its own (``group_tables``);
    everything else is the runtime's.
    """

    def __init__(self, runtime: PrefillRuntime, blocks_per_group: int):
        self.runtime = runtime
        self.blocks_per_group = blocks_per_group
        self.num_groups = len(runtime.config.model.attention.groups)

    def _tables(self, page_table) -> list[torch.Tensor]:
        return group_tables(page_table, self.num_groups, self.blocks_per_group)

    def prepare(self, tokens, page_table, *args, **kwargs):
        tables = self._tables(page_table)
        return self.runtime.prepare(tokens, tables[0], *args, group_page_tables=tables, null_block=None, **kwargs)

    def prefill(
        self,
        tokens,
        page_table,
        prompt_lengths,
        cached_lengths=None,
        slots=None,
        sampling=None,
        *,
        mode: ExecutionMode | str = ExecutionMode.AUTO,
        on_progress=None,
    ):
        tables = self._tables(page_table)
        call = (tokens, tables[0], prompt_lengths, cached_lengths, slots, sampling, mode, on_progress)
        return PrefillExecutor(self.runtime).prefill(*call, group_page_tables=tables, null_block=None)

    def __getattr__(self, name: str):
        return getattr(self.runtime, name)


def command_runtime(
    model, layout: PageTableLayout, device: str = "cpu", policy: PrefillPolicy | None = None
) -> PrefillRuntime | GroupTablesRuntime:
    """A torch runtime on ``device`` whose callers use block ids ``0 <= id < layout.num_blocks`` in one table per row.

    A plain model gets a pool of ``layout``'s blocks; a hybrid model (one with
    an ``attention`` layout of KV groups) one of ``groups x layout.num_blocks``,
    behind a ``GroupTablesRuntime``. ``policy``: the backend's preferred one by default.
    """
    attention = getattr(model, "attention", None)
    backend = TorchBackend(device)
    if attention is None:
        kv = model.new_kv_cache(layout.num_blocks, layout.block_size)
        return PrefillRuntime(PrefillRuntimeConfig.resolve(model, backend, kv, layout=layout, policy=policy))
    sizes = sorted({group.block_size for group in attention.groups})
    if sizes != [layout.block_size]:
        msg = f"the model's KV groups take blocks of {sizes} tokens, the command's pool {layout.block_size}"
        raise PrefillConfigError(msg)
    num_groups = len(attention.groups)
    pool = attrs.evolve(layout, num_blocks=layout.num_blocks * num_groups)
    kv = model.new_kv_cache(pool.num_blocks)
    runtime = PrefillRuntime(PrefillRuntimeConfig.resolve(model, backend, kv, layout=pool, policy=policy))
    return GroupTablesRuntime(runtime, layout.num_blocks)
