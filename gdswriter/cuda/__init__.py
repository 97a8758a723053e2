"""CUDA-specific pieces of gdswriter, each behind a narrow interface: the GPUDirect Storage
engine (gds.py, via KvikIO), crc32c computed on the GPU (checksum.py), and events, side
streams, stream-ordered waits and pinned registration for snapshots (streams.py). Importing
them makes no CUDA call and needs neither KvikIO nor a GPU: a job whose state holds no CUDA
tensor never initialises CUDA through gdswriter."""
