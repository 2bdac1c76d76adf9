"""Re-encode format-1 plan files as format 2 (the whole file sealed, every field checked): `python
scripts/upgrade_plan_v1.py FILE...`. The body bytes are kept as they are, which proves the decoded plan is unchanged;
the file is then read back by the format-2 reader, which checks every field. Format 1 left its header unsealed: only
upgrade files you recorded yourself (re-recording is always safe)."""

import hashlib
import struct
import sys

import msgpack

from shardplan.plan.file import format as planfile
from shardplan.plan.layout import Layout


def upgrade(path: str) -> None:
    data = open(path, "rb").read()
    assert data[:8] == planfile.MAGIC and struct.unpack_from("<I", data, 8)[0] == 1, f"{path}: not a format-1 plan"
    (header_len,) = struct.unpack_from("<Q", data, 12)
    header = msgpack.unpackb(data[20 : 20 + header_len], raw=False)
    (body_len,) = struct.unpack_from("<Q", data, 20 + header_len)
    body_bytes = data[28 + header_len : 28 + header_len + body_len]
    assert len(data) == 28 + header_len + body_len, f"{path}: trailing bytes"
    assert hashlib.sha256(body_bytes).hexdigest() == header["body_sha256"], f"{path}: body checksum mismatch"
    raw = msgpack.unpackb(body_bytes, raw=False, use_list=False, strict_map_key=True)
    body = planfile._decode_body(raw, path)
    new = planfile.encode(
        body,
        model=header["model"],
        architecture=header["architecture"],
        config_sha256=header["config_sha256"],
        layout=Layout.from_dict(header["layout"]),
        dtype=header["dtype"],
        vllm_version=header["vllm_version"],
    )
    h2, _ = planfile.decode(new, path)
    new_header_len, new_body_len = struct.unpack_from("<QQ", new, 12)
    assert new[28 + new_header_len : 28 + new_header_len + new_body_len] == body_bytes, f"{path}: body changed"
    assert h2.ranks == tuple(header["ranks"]) and h2.shardplan_version == header["shardplan_version"]
    planfile.write_plan(path, new)
    print(f"{path}: format 1 -> 2, body bytes identical ({body_len} bytes, {sum(h2.num_writes)} writes)")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        upgrade(p)
