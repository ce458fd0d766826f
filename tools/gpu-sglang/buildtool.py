#!/usr/bin/env python3
"""Build-side helpers for build.sh (stdlib only, any Python >= 3.9).

buildtool.py unpack DIR WHEEL... [--drop RELPATH]...
    Unpack wheels into DIR as ``pip install --target`` would lay them out
    (``*.data/purelib`` and ``platlib`` merged into DIR; scripts, headers and
    data dropped; no ``__pycache__``), leaving out each RELPATH (a file, or a
    folder with all under it); a RELPATH that matches nothing is an error.
    Unlike pip it writes no INSTALLER/direct_url.json, so the result depends
    only on the wheels: the same wheels give the same bytes.
buildtool.py cut-sm90 SRC DST
    Copy an ELF shared library, cutting each fatbin container of its
    ``.nv_fatbin`` section to the sm_90 cubins (or, in a container without
    one, its PTX for <= 9.0). Containers with nothing for sm_90 stay as they
    are. Layout, symbols and relocations are unchanged.
buildtool.py edit FILE OLD NEW
    Replace the one line of FILE that equals OLD (whitespace included) by NEW;
    no such line, or more than one, is an error (the wheel changed: look again).
"""

from __future__ import annotations

import os
import shutil
import struct
import sys
import zipfile


def unpack(dest: str, wheels: list[str], drops: list[str]) -> None:
    os.makedirs(dest, exist_ok=True)
    used = set()
    for whl in wheels:
        with zipfile.ZipFile(whl) as z:
            for info in z.infolist():
                name = info.filename
                if name.endswith("/"):
                    continue
                parts = name.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue  # scripts, headers, data: not needed on the device
                    parts = parts[2:]
                if "__pycache__" in parts or name.endswith(".pyc"):
                    continue
                rel = "/".join(parts)
                hit = next((d for d in drops if rel == d or rel.startswith(d + "/")), None)
                if hit is not None:
                    used.add(hit)
                    continue
                out = os.path.join(dest, *parts)
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with z.open(info) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                executable = (info.external_attr >> 16) & 0o111
                os.chmod(out, 0o755 if executable else 0o644)
    unused = [d for d in drops if d not in used]
    if unused:
        sys.exit(
            f"buildtool: --drop {' '.join(unused)}: in none of the wheels (have they changed?)"
        )


def _section(buf: bytes, wanted: str) -> tuple[int, int]:
    """(file offset, size) of an ELF64 little-endian section, by name."""
    if buf[:4] != b"\x7fELF" or buf[4] != 2 or buf[5] != 1:
        sys.exit("buildtool: not an ELF64 little-endian file")
    shoff = struct.unpack_from("<Q", buf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", buf, 0x3A)
    strtab_off = struct.unpack_from("<Q", buf, shoff + shstrndx * shentsize + 0x18)[0]
    for i in range(shnum):
        h = shoff + i * shentsize
        name_off = struct.unpack_from("<I", buf, h)[0]
        end = buf.index(b"\0", strtab_off + name_off)
        if buf[strtab_off + name_off : end].decode() == wanted:
            return struct.unpack_from("<QQ", buf, h + 0x18)
    sys.exit(f"buildtool: no {wanted} section")


def cut_sm90(src: str, dst: str) -> None:
    with open(src, "rb") as f:
        buf = bytearray(f.read())
    so, sz = _section(buf, ".nv_fatbin")
    off, end, kept, dropped, untouched, n90 = so, so + sz, 0, 0, 0, 0
    while off + 16 <= end:
        magic, _ver, hsz, fsz = struct.unpack_from("<IHHQ", buf, off)
        if magic != 0xBA55ED50:  # containers are 8-aligned; skip padding
            off += 8
            continue
        p, cend, ents = off + hsz, off + hsz + fsz, []
        while (
            p < cend
        ):  # entry: kind (1 PTX, 2 ELF), .., header size, payload size, .., arch at +28
            kind, _, ehs, psz = struct.unpack_from("<HHIQ", buf, p)
            arch = struct.unpack_from("<I", buf, p + 28)[0]
            ents.append((p, kind, ehs, psz, arch))
            p += ehs + psz
        has90 = any(k == 2 and a == 90 for _, k, _, _, a in ents)
        keep = [
            e
            for e in ents
            if (e[1] == 2 and e[4] == 90) or (not has90 and e[1] == 1 and e[4] <= 90)
        ]
        if keep:  # compact the kept entries to the front, shrink fatSize, zero the tail
            new = b"".join(bytes(buf[e[0] : e[0] + e[2] + e[3]]) for e in keep)
            buf[off + hsz : cend] = new + bytes(fsz - len(new))
            struct.pack_into("<Q", buf, off + 8, len(new))
            kept += len(new)
            dropped += fsz - len(new)
            n90 += sum(1 for e in keep if e[1] == 2)
        else:
            untouched += 1  # nothing for sm_90 in it (e.g. sm_100 only): never loaded on an H200
        off = cend
    with open(dst, "wb") as f:
        f.write(buf)
    print(
        f"fatbin cut to sm_90: kept {kept / 1e6:.1f} MB ({n90} sm_90 cubins), dropped "
        f"{dropped / 1e6:.1f} MB, {untouched} containers without sm_90 left as they were"
    )


def edit(path: str, old: str, new: str) -> None:
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    hits = [i for i, line in enumerate(lines) if line == old]
    if len(hits) != 1:
        sys.exit(f"buildtool: edit {path}: {len(hits)} lines equal {old!r}, not one")
    lines[hits[0]] = new
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "unpack":
        rest, drops, wheels = argv[2:], [], []
        while rest:
            a = rest.pop(0)
            if a == "--drop":
                drops.append(rest.pop(0))
            else:
                wheels.append(a)
        unpack(argv[1], wheels, drops)
    elif len(argv) == 3 and argv[0] == "cut-sm90":
        cut_sm90(argv[1], argv[2])
    elif len(argv) == 4 and argv[0] == "edit":
        edit(argv[1], argv[2], argv[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
