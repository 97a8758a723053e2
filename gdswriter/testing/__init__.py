"""Tools for testing code that uses gdswriter, and gdswriter itself: a fault-injecting engine
(faults.py), a simulated coordinator (simcoord.py), and ``log_once_forgotten`` (one-time
messages said again within a block).

The package's own test seams are public names of the modules that run them, each documented
there; a test wraps one (monkeypatch the module or object attribute: the code looks it up at
each call, so production pays nothing) to delay a step or inject a fault at exactly that point:

* save/pool.py: ``copy_all`` (the copier thread), ``copy_in`` (one chunk into the pool),
  ``allocate`` (the ring's placement), ``new_region`` (mapping a pool), ``Piece``;
* save/snapshot.py: ``group_by_allocation`` (one layout of the state);
* engines/staged.py: ``copy_bytes`` (every staging copy), ``crc_extend`` (every checksum step);
* engines/buffers.py: ``mlock`` (one step of locking a pool);
* engines/uring.py: ``Ring.enter_syscall`` (one io_uring_enter);
* engines/kvikio.py: ``on_gpu`` (what counts as device memory);
* distributed/crossmem.py: ``process_vm_readv`` (the bound syscall);
* session.py: ``LocalSession.new_plan`` (a save's plan);
* tools/doctor.py: ``read_system_file``, ``can_lock_any``;
* integrations/transformers.py: ``publish_checkpoint``, ``delete_rotated``.

Keep them module-level and looked up at call time. tests/test_package.py fails when a test
reaches into a private name not in its allowlist.
"""

from .._log import log_once_forgotten

__all__ = ["log_once_forgotten"]
