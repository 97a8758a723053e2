"""torch.distributed.checkpoint (DCP) on gdswriter's engine, format and commit protocol.

    dcp.save(state_dict, checkpoint_id="ckpts/step-100", storage_writer=GDSStorageWriter())
    dcp.load(state_dict, checkpoint_id="ckpts/step-100", storage_reader=GDSStorageReader())
    dcp.save(state_dict, storage_writer=GDSStorageWriter(root, step=100))   # steps under one root
    dcp.load(state_dict, storage_reader=GDSStorageReader(root))             # its latest step
    dcp.async_save(state_dict, checkpoint_id=path, storage_writer=GDSStorageWriter(), ...)

What a checkpoint_id names (``reset``, which DCP calls with it before anything else):

* a path (a str that is not all digits, or any os.PathLike), as for FileSystemWriter: the path
  names one checkpoint. The directory becomes a gdswriter root holding that checkpoint as one
  step, numbered by the number its name ends with after "step" (``step-100``, ``step_100``:
  100; else 0), so ``gdswriter ls/inspect/verify/export PATH`` work on it and removing the
  directory removes the checkpoint. After the step commits, the coordinator writes PATH/.metadata,
  a small JSON marker (not DCP's pickle), so tools that look for DCP checkpoints by that file
  (torchtitan's resume) find complete ones only; FileSystemReader cannot read it (pickle
  reports "invalid load key"): load with GDSStorageReader. A writer made with several roots
  (SSDs) maps a path under its first root to the same relative path under each root.
* a step number (an int, or a str of digits): that step under the roots given at construction.

``overwrite=False`` refuses (CheckpointExistsError, raised on every rank) a save whose target
already holds a checkpoint: the step it names, or, for a path or a root given without a step,
any committed step there (or a DCP ``.metadata``), as FileSystemWriter refuses a directory
holding one. With ``overwrite=True`` (the default, as FileSystemWriter's) a re-saved step
replaces the old one in one atomic exchange, with a warning.

DCP plans (which rank saves which chunk of which tensor; resharding on load); gdswriter
stores. A checkpoint is a step under its root like any other: every DCP item is a storage with
one tensor record named by its fully qualified name (a chunk of a sharded tensor records its
block as ``shard``; a BytesIO item is a uint8 tensor of its bytes), and DCP's Metadata is
stored as JSON in the manifest's ``dist.dcp`` (dcp_codec.py; no pickle). Tensor items that
several ranks hold (replicated state, which DCP would give whole to one rank) are split across
their holders by planner/ranks.py, as GDSCheckpointer does. The commit is dist/commit.py's,
carried by DCP's own protocol (commit.py OrderedCommit): the coordinator decides the step and
the temporary directories' token in ``prepare_global_plan`` (DCP scatters them in the plans),
every rank writes and makes its files durable (and publishes the secondary roots it alone
sees) in ``write_data``, whose WriteResults carry its report (files, chunks, crc32c, records)
to the coordinator in DCP's gather, and ``finish`` checks the reports and commits. DCP runs
``finish`` only when every rank's ``write_data`` succeeded, and raises on every rank otherwise
(and when ``finish`` raises): nothing is then committed. The storage side adds no collective to
a save's, also where the writer opens its roots (at its first save, for a new checkpoint_id
directory, after a save that failed before writing): each rank's ``set_up_storage_writer``
makes its roots and their identities and probes them (rank 0, which leads every root it sees,
under their lock), its local plan carries that to the coordinator, which builds the table of
distinct roots (by identity), chooses the primary (refused unless it is rank 0's) and sends
each rank its part of the table in its global plan (opening.py's round, the one
GDSCheckpointer's open_session runs over its own channel, carried by DCP's gather and scatter); the other ranks lock the roots they lead
in ``write_data``, check that they did not change since they probed them, and clean them. A
root that several ranks see but another rank than rank 0 leads (one SSD per node shared by
that node's ranks: a joint root) is published by its own ranks inside ``write_data``: each
marks in the step's temporary directory there that its files are durable, and the one that
finds every sharing rank's mark renames it (commit.py OrderedCommit: "the last one
publishes"); the reports say who published what, and ``finish`` refuses to commit a step with a
joint root that nobody published (a copied root). Re-saving a committed step, a rank leading a
secondary root writes beside the committed files, in the committed step directory, under names
of its own (OrderedCommit), so nothing of the old step changes before the coordinator's commit;
the files no committed manifest names are removed at the writer's next save, whichever
checkpoint_id it targets (the ranks say where they wrote beside a step in their local plans, the
coordinator sends each root's leader the names the committed manifest lists there in its global
plan; the roots of an earlier checkpoint_id are kept for that: _lock_formers, _formers_live).
The writer never makes a coordination channel of its own. What travels in DCP's plans and
results (``storage_data``) is typed in dcp_messages.py and sent as plain lists and dicts.

Loading reads each item DCP asks for whole straight into DCP's target tensor (its checksum
computed as it is read) and only resharded or cast items through a buffer, as FileSystemReader
copies each item into its target as it goes: a damaged file raises ChecksumMismatchError on
every rank, and the targets read so far are overwritten. Where every rank names one root, the
same one, a load adds one round of collectives to DCP's (rank 0 sends the manifest with the
decision, ``dcp_reader.open_one_shared_root``) and each rank reads alone, DCP's gather of read_data's
outcomes carrying a failure to every rank; other layouts open and read as GDSCheckpointer
does. ``GDSStorageReader(atomic=True)`` reads everything into fresh buffers, verifies it on
every rank, and only then changes a target.

Errors. DCP runs the storage layer's calls inside its collectives and wraps what they raise in
``CheckpointException`` (a BaseException: ``except Exception`` misses it), whose message ends
with gdswriter's. What DCP calls outside them raises gdswriter's typed error itself: the
constructors' option checks and ``reset``'s check of the checkpoint_id (a URL, a negative step).
``dcp_errors()`` re-raises the gdswriter error inside a CheckpointException (the failing rank's
own, before the other ranks' RankFailedError), from it, so ``except CheckpointExistsError`` works.

Between saves the writer keeps its engines (io_uring rings and page-locked staging buffers,
which take 25-150 ms to build per root) and its opened roots (their table and identities, not
their locks: each save takes those again, locally); ``close()`` releases both. A reader keeps
its one engine. The writer and reader pickle as their arguments, so DCP's process-based async_save
can ship them to its checkpoint process; engines, locks and the coordination group open there
on first use.

The plug-in's modules (this one re-exports their public names): dcp_paths.py (checkpoint_id,
the marker), dcp_failures.py (errors across DCP's collectives), dcp_messages.py, dcp_writer.py
with dcp_writer_parts.py, dcp_reader.py, dcp_offline.py (export's reads), dcp_codec.py.
"""


from __future__ import annotations

from .dcp_failures import CarriedError, dcp_errors
from .dcp_offline import dcp_items, dcp_model_keys, is_dcp_step, read_dcp_items
from .dcp_paths import MARKER_FORMAT, MARKER_NAME, is_gdswriter_marker, parse_checkpoint_id, step_in_name
from .dcp_reader import GDSStorageReader, check_dcp_records, reader_engine_options
from .dcp_writer import GDSStorageWriter
from .dcp_writer_parts import REPORT_FQN

__all__ = ["GDSStorageWriter", "GDSStorageReader", "dcp_errors", "CarriedError", "MARKER_NAME", "MARKER_FORMAT",
           "REPORT_FQN", "step_in_name", "parse_checkpoint_id", "is_gdswriter_marker", "reader_engine_options",
           "check_dcp_records", "is_dcp_step", "dcp_items", "dcp_model_keys", "read_dcp_items"]
