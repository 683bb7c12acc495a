#!/usr/bin/env python3
"""Extract the uncompressed ELF vmlinux from a Debian bzImage (/boot/vmlinuz-*).

qemu boots an uncompressed ELF vmlinux through its PVH entry point, which skips the real-mode setup
and the in-guest decompression (~2.5 s faster under TCG).

Usage: extract-vmlinux.py VMLINUZ OUT
"""
import lzma
import sys
import zlib

MAGICS = ((b"\xfd7zXZ\x00", "xz"), (b"\x1f\x8b\x08", "gzip"))


def decompress(name, blob):
    if name == "xz":
        return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(blob)
    return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(blob)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = sys.argv[1], sys.argv[2]
    with open(src, "rb") as f:
        data = f.read()
    for magic, name in MAGICS:
        i = data.find(magic)
        while i >= 0:
            try:
                elf = decompress(name, data[i:])
            except (lzma.LZMAError, zlib.error, EOFError):
                elf = b""
            if elf[:4] == b"\x7fELF":
                with open(out, "wb") as f:
                    f.write(elf)
                print(f"{out}: {len(elf)} bytes ({name} payload at offset {i})")
                return
            i = data.find(magic, i + 1)
    sys.exit(f"no compressed ELF payload (xz/gzip) found in {src}")


if __name__ == "__main__":
    main()
