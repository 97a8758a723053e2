"""Helpers shared by the test modules (no test module imports another).

``tests/`` is on ``sys.path`` when pytest runs (rootdir-relative ``prepend`` import mode, as
tests/ has no ``__init__.py``) and in the ``PYTHONPATH`` the tests give their child
processes, so ``from support import models`` works in both; ``conftest.py`` registers this
package for pytest's assertion rewriting.

- ``models``: a small deterministic training setup, small engine/checkpoint options, crash states.
- ``trees``: ``assert_same_tree`` for nested states.
- ``ranks``: ``run_ranks``, a function on N spawned ranks joined by torch.distributed (gloo).
- ``engines``: the engine contract's engines and span helpers, the KvikIO engine's kinds
  (the fake KvikIO, CUDA-memory wrapper), planted non-regular files.
- ``fake_kvikio``: a stand-in for KvikIO (it cannot import without an NVIDIA driver).
- ``timeouts``: ``deadline``, failing a test body that hangs.
- ``nodes``: simulated nodes (namespaces: own hostname, /dev/shm, /local_nvme) to kill and
  replace mid-save; ``nodeinit`` and ``noderank`` are the processes it starts in each node.
"""
