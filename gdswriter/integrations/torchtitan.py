"""torchtitan's checkpoints through gdswriter: GDSCheckpointManager, torchtitan's own
CheckpointManager (0.3.0) saving with GDSStorageWriter and loading with GDSStorageReader.

A torchtitan user selects it in one line of the trainer's config::

    from gdswriter.integrations.torchtitan import GDSCheckpointManager
    config.checkpoint = GDSCheckpointManager.Config(enable=True, folder="checkpoint", async_mode="async")

Why a subclass with its own nested ``Config``: torchtitan's ``Configurable`` builds the class that
declares the Config (``Config._owner``); a subclass without one would silently get the stock
manager, saving with FileSystemWriter. Everything else is torchtitan's: the ``step-N`` folders,
``interval``, ``keep_latest_k``'s purge, ``_find_load_step`` (each committed gdswriter step
writes its ``.metadata`` marker last), ``initial_load_path``, the HF export and import (left to
torchtitan's own writer and reader). Loading reads both gdswriter steps and the ``step-N``
folders DCP's FileSystemWriter wrote before the switch (distributed/dcp_fsreader.py: no
unpickling outside an allowlist), so a job switches without losing its history.

Async modes: "disabled" and "async" (threads; gdswriter's collectives run on torchtitan's
checkpoint group ``self.pg``). "async_with_pinned_mem" is refused: its DefaultStager stages into
CUDA pinned memory and sends the writer to a checkpoint process, which was not tested here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools.utils import GarbageCollection

from ..distributed import GDSStorageReader, GDSStorageWriter
from ..errors import InvalidOptionError


class GDSCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager with gdswriter's DCP plug-in (see the module docstring).
    One GDSStorageWriter is kept for the manager's life (its engines are built once) and
    closed with it (``close()``, which torchtitan's trainer calls)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's checkpoint options; builds a GDSCheckpointManager."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM.value:
                raise InvalidOptionError(
                    "checkpoint.async_mode='async_with_pinned_mem' is not supported by GDSCheckpointManager "
                    "(its stager pins CUDA memory for a separate checkpoint process, untested with gdswriter): "
                    "use 'async' (gdswriter copies the state and writes it in the background) or 'disabled'")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        self.gds_writer: GDSStorageWriter | None = None
        super().__init__(config, **kwargs)
        if not self.enable:
            return  # torchtitan returned before self.pg exists: nothing to open or close
        self.gds_writer = GDSStorageWriter(process_group=self.pg)

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        """torchtitan's dcp_save with the kept GDSStorageWriter (an HF export keeps torchtitan's writer)."""
        if to_hf or self.gds_writer is None:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=self.gds_writer, checkpoint_id=checkpoint_id,
                                 process_group=self.pg)
        else:
            ret = dcp.save(state_dict, storage_writer=self.gds_writer, checkpoint_id=checkpoint_id)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """torchtitan's dcp_load, reading through GDSStorageReader: a gdswriter step or a folder
        DCP's FileSystemWriter wrote (an HF import keeps torchtitan's reader)."""
        if from_hf:
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        reader = GDSStorageReader()
        try:
            dcp.load(state_dict, checkpoint_id=checkpoint_id, storage_reader=reader)
        finally:
            reader.close()
        if MODEL in self.states:  # as torchtitan does: the model's states are flattened into state_dict
            self.states[MODEL].load_state_dict(state_dict)

    def _close(self) -> None:
        """torchtitan's close (purge thread, stager), then the kept writer's engines and locks."""
        try:
            super()._close()
        finally:
            writer, self.gds_writer = self.gds_writer, None
            if writer is not None:
                writer.close()
