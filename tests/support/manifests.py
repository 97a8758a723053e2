"""rows_of: a manifest.json body as 1.x rows, whatever its format, for tests that look into a
step's records (a 2.0 manifest's column tables turned into rows as docs/format.md section 8's
``rows_of`` does; a 1.x body returned as it is)."""

from __future__ import annotations


def rows_of(m: dict) -> dict:
    if m.get("version", [1, 0])[0] < 2:
        return m
    s, t = m["storages"], m["tensors"]
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
