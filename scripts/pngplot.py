"""A PNG line-plot canvas in pure Python (zlib), shared by the benchmark scripts.

The project does not depend on a plotting library; the benchmarks only need lines,
rectangles and a little text, written as an 8-bit RGB PNG.
"""

import struct
import zlib
from pathlib import Path

__all__ = ["BLACK", "BLUE", "GREEN", "GREY", "GRID", "ORANGE", "RED", "WHITE", "Canvas"]

# 5x7 glyphs, one row of five pixels per group, top row first.
_FONT = {
    " ": "00000 00000 00000 00000 00000 00000 00000",
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11111 00010 00100 00010 00001 10001 01110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    "A": "01110 10001 10001 11111 10001 10001 10001", "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110", "D": "11100 10010 10001 10001 10001 10010 11100",
    "E": "11111 10000 10000 11110 10000 10000 11111", "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111", "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110", "J": "00111 00010 00010 00010 00010 10010 01100",
    "K": "10001 10010 10100 11000 10100 10010 10001", "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001", "N": "10001 10001 11001 10101 10011 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110", "P": "11110 10001 10001 11110 10000 10000 10000",
    "Q": "01110 10001 10001 10001 10101 10010 01101", "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110", "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110", "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010", "X": "10001 10001 01010 00100 01010 10001 10001",
    "Y": "10001 10001 10001 01010 00100 00100 00100", "Z": "11111 00001 00010 00100 01000 10000 11111",
    "(": "00010 00100 01000 01000 01000 00100 00010", ")": "01000 00100 00010 00010 00010 00100 01000",
    "=": "00000 00000 11111 00000 11111 00000 00000", "+": "00000 00100 00100 11111 00100 00100 00000",
    ",": "00000 00000 00000 00000 01100 00100 01000", ".": "00000 00000 00000 00000 00000 01100 01100",
    "-": "00000 00000 00000 11111 00000 00000 00000", "/": "00000 00001 00010 00100 01000 10000 00000",
    ":": "00000 01100 01100 00000 01100 01100 00000",
}
WHITE, BLACK, GRID = (255, 255, 255), (0, 0, 0), (225, 225, 225)
BLUE, RED, GREY = (31, 90, 180), (200, 50, 40), (130, 130, 130)
GREEN, ORANGE = (40, 150, 70), (230, 140, 20)


class Canvas:
    """An RGB image with just enough drawing for a line plot."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def rect(self, x: int, y: int, w: int, h: int, color: tuple[int, int, int]) -> None:
        for row in range(max(y, 0), min(y + h, self.height)):
            x0, x1 = max(x, 0), min(x + w, self.width)
            if x1 > x0:
                self.pixels[(row * self.width + x0) * 3:(row * self.width + x1) * 3] = bytes(color) * (x1 - x0)

    def line(self, x0: float, y0: float, x1: float, y1: float, color, width: int = 1, dash: int = 0) -> None:
        steps = max(int(max(abs(x1 - x0), abs(y1 - y0))), 1)
        for i in range(steps + 1):
            if dash and (i // dash) % 2:
                continue
            x, y = x0 + (x1 - x0) * i / steps, y0 + (y1 - y0) * i / steps
            self.rect(round(x - width / 2), round(y - width / 2), width, width, color)

    def text(self, x: int, y: int, s: str, color=BLACK, scale: int = 2) -> None:
        for i, char in enumerate(s.upper()):
            for row, bits in enumerate(_FONT[char].split()):
                for col, bit in enumerate(bits):
                    if bit == "1":
                        self.rect(x + (6 * i + col) * scale, y + row * scale, scale, scale, color)

    def legend(self, x: int, y: int, entries, step: int) -> None:
        """One row per ``(color, dash, label)``, ``step`` pixels apart from ``y``: a line sample
        as the curves draw it, then the label."""
        for i, (color, dash, label) in enumerate(entries):
            row = y + step * i
            self.line(x, row, x + 40, row, color, 3, dash)
            self.text(x + 52, row - 7, label)

    @staticmethod
    def text_width(s: str, scale: int = 2) -> int:
        return 6 * len(s) * scale - scale

    def save(self, path: Path) -> None:
        stride = self.width * 3
        raw = b"".join(b"\x00" + bytes(self.pixels[r * stride:(r + 1) * stride]) for r in range(self.height))

        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png)
