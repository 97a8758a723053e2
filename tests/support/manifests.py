"""rows_of: a manifest.json body as 1.x rows, whatever its format, for tests that look into a
step's records (a 2.0 or 3.0 manifest's column tables turned into rows as docs/format.md
section 8's ``rows_of`` does; a 1.x body returned as it is)."""

from __future__ import annotations

import base64

import numpy as np

_NAMES = ("name", "dtype_names", "device_names")


def ints(col: list | str) -> list:
    """An integer column as a list: 2.x's JSON list, or 3.0's "<width>:<base64>"."""
    if isinstance(col, list):
        return col
    width, text = col.split(":", 1)
    return np.frombuffer(base64.b64decode(text), dtype="<i8" if width == "8" else f"<u{width}").tolist()


def rows_of(m: dict) -> dict:
    if m.get("version", [1, 0])[0] < 2:
        return m
    s = {k: ints(v) for k, v in m["storages"].items()}
    t = {k: v if k in _NAMES else ints(v) for k, v in m["tensors"].items()}
    chunks = [list(c) for c in zip(s["file"], s["file_offset"], s["storage_offset"], s["length"], s["crc32c"])]
    storages, at = [], 0
    for nbytes, n in zip(s["nbytes"], s["chunks"]):
        storages.append({"nbytes": nbytes, "chunks": chunks[at:at + n]})
        at += n
    kinds = ["tensor", "ndarray"]
    tensors, at = [], 0
    for i, k in enumerate(t["ndim"]):
        tensors.append({"name": t["name"][i], "storage": t["storage"][i], "byte_offset": t["byte_offset"][i],
                        "dtype": t["dtype_names"][t["dtype"][i]], "shape": t["shape"][at:at + k],
                        "stride": t["stride"][at:at + k], "device": t["device_names"][t["device"][i]],
                        "kind": kinds[t["kind"][i]]})
        at += k
    return {**m, "storages": storages, "tensors": tensors}
