#!/usr/bin/python3
"""What a PNG shows, counted: an oracle for the picture tests, with only the standard library
(zlib, struct), sharing nothing with strata.

Usage: png_stats.py FILE.png [RRGGBB ...]
Prints one JSON object:
  width, height
  non_white: pixels not (near) white      dark: pixels darker than #808080 on every channel (text)
  colors: distinct colours                hits: for each RRGGBB given, the pixels within 24 of it
                                          on every channel (a line of that colour was drawn)
Only 8-bit greyscale, RGB and RGBA images, not interlaced (what Chromium's screenshots are).
"""
import json
import struct
import sys
import zlib


def decode(path):
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:8] != b"\x89PNG\r\n\x1a\n":
        sys.exit(f"{path}: not a PNG file")
    pos, idat, ihdr = 8, b"", None
    while pos < len(raw):
        (length,) = struct.unpack(">I", raw[pos:pos + 4])
        kind = raw[pos + 4:pos + 8]
        data = raw[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", data)
        elif kind == b"IDAT":
            idat += data
        elif kind == b"IEND":
            break
    width, height, depth, ctype, _, _, interlace = ihdr
    channels = {0: 1, 2: 3, 6: 4}.get(ctype)
    if depth != 8 or channels is None or interlace != 0:
        sys.exit(f"{path}: bit depth {depth}, colour type {ctype}, interlace {interlace}: "
                 "only 8-bit grey, RGB and RGBA, not interlaced")
    pixels = zlib.decompress(idat)
    stride = width * channels
    rows, prev, at = [], bytearray(stride), 0
    for _ in range(height):
        filt = pixels[at]
        line = bytearray(pixels[at + 1:at + 1 + stride])
        at += 1 + stride
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if filt == 1:
                line[i] = (line[i] + a) & 255
            elif filt == 2:
                line[i] = (line[i] + b) & 255
            elif filt == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif filt == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 255
            elif filt != 0:
                sys.exit(f"{path}: unknown row filter {filt}")
        rows.append(line)
        prev = line
    return width, height, channels, rows


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    width, height, channels, rows = decode(sys.argv[1])
    targets = [tuple(int(h[i:i + 2], 16) for i in (0, 2, 4)) for h in sys.argv[2:]]
    hits = [0] * len(targets)
    colors, non_white, dark = set(), 0, 0
    for line in rows:
        for x in range(width):
            px = line[x * channels:(x + 1) * channels]
            rgb = (px[0], px[0], px[0]) if channels == 1 else (px[0], px[1], px[2])
            colors.add(rgb)
            if min(rgb) < 245:
                non_white += 1
            if max(rgb) < 128:
                dark += 1
            for k, t in enumerate(targets):
                if all(abs(rgb[j] - t[j]) <= 24 for j in range(3)):
                    hits[k] += 1
    print(json.dumps({"width": width, "height": height, "non_white": non_white, "dark": dark,
                      "colors": len(colors),
                      "hits": {h: n for h, n in zip(sys.argv[2:], hits)}}))


if __name__ == "__main__":
    main()
