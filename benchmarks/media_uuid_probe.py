#!/usr/bin/env python3
"""One key naming another key's media ``uuid``: does it get the other's image? (vLLM's media caches, on a real VLM.)

vLLM takes a content part's ``uuid`` as the media item's hash (vLLM "Multimodal Inputs", "Stable UUIDs for
Caching"): the key of its multimodal processor cache and its encoder cache, which ``cache_salt`` does not
enter, and a part that sends the uuid alone (``"image_url": null``) reuses the item cached under it. A
"victim" key sends a picture with ``uuid`` U; a "thief" key then sends only ``{"image_url": null, "uuid": U}``
and asks what the picture shows. Where uuids are relayed as sent (vllama before the media-uuid change, or
``--cache-isolation off``), the thief's answer describes the victim's picture; where each key's uuids are
its own, vLLM finds nothing under the thief's uuid and answers 400 (nothing cached for it). The victim
sending U again without the data still works (its own cache).

The picture is drawn here (a red square with a white cross; no download): the victim's answer and the
thief's are printed side by side. Run vllama serving a vision model (e.g. ``Qwen/Qwen2.5-VL-3B-Instruct``)
with a keys file holding two user keys, sk-victim and sk-thief:

    python benchmarks/media_uuid_probe.py --url http://127.0.0.1:11434 --model M [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import secrets
import struct
import zlib

import httpx


def red_cross_png(size: int = 224) -> str:
    """A ``data:`` URL of a PNG: a red square with a white cross (stdlib only)."""
    rows = []
    for y in range(size):
        row = bytearray([0])
        for x in range(size):
            white = abs(x - size // 2) < size // 12 or abs(y - size // 2) < size // 12
            row += bytes((255, 255, 255) if white else (220, 20, 20))
        rows.append(bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    out = io.BytesIO()
    out.write(b"\x89PNG\r\n\x1a\n")
    out.write(chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)))
    out.write(chunk(b"IDAT", zlib.compress(b"".join(rows))))
    out.write(chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def ask(client: httpx.Client, url: str, model: str, key: str, part: dict) -> tuple[int, str]:
    body = {"model": model, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What colours and shapes does this picture show?"}]}]}
    r = client.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    try:
        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
    except (ValueError, KeyError, IndexError):
        text = r.text
    return r.status_code, text[:300]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:11434")
    ap.add_argument("--model", required=True)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    uuid = f"photo-{secrets.token_hex(4)}"
    image = red_cross_png()
    with httpx.Client(timeout=600) as c:
        rows = {
            "victim_with_data": ask(c, args.url, args.model, "sk-victim", {"type": "image_url", "image_url": {"url": image}, "uuid": uuid}),
            "victim_uuid_only": ask(c, args.url, args.model, "sk-victim", {"type": "image_url", "image_url": None, "uuid": uuid}),
            "thief_uuid_only": ask(c, args.url, args.model, "sk-thief", {"type": "image_url", "image_url": None, "uuid": uuid}),
        }
    for name, (status, text) in rows.items():
        print(f"{name}: {status} {text!r}")
    leaked = rows["thief_uuid_only"][0] == 200
    print("the thief got the victim's picture" if leaked else "the thief got nothing under the victim's uuid")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "uuid": uuid, "rows": rows, "leaked": leaked}, f, indent=1)


if __name__ == "__main__":
    main()
