"""CUDA-side pieces of gdswriter: the GPUDirect Storage engine (gds.py, via KvikIO) and crc32c
computed on the GPU (checksum.py). Importing them needs neither KvikIO nor a GPU."""
