"""A line chart written as a PNG with NumPy and zlib alone (the venv has no matplotlib or Pillow).

``line_chart(path, title, x_labels, series, y_label)`` draws each series as a coloured polyline with
markers over evenly spaced x positions, a y axis with ticks, a dashed reference line at y = 1 and a
legend; text uses a built-in 3x5 pixel font (upper case, digits, a few signs), scaled 2x.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

# 3x5 glyphs: five rows of three bits each (bit 2 = left column).
GLYPHS = {
    "A": (2, 5, 7, 5, 5), "B": (6, 5, 6, 5, 6), "C": (3, 4, 4, 4, 3), "D": (6, 5, 5, 5, 6), "E": (7, 4, 6, 4, 7),
    "F": (7, 4, 6, 4, 4), "G": (3, 4, 5, 5, 3), "H": (5, 5, 7, 5, 5), "I": (7, 2, 2, 2, 7), "J": (1, 1, 1, 5, 2),
    "K": (5, 5, 6, 5, 5), "L": (4, 4, 4, 4, 7), "M": (5, 7, 7, 5, 5), "N": (6, 5, 5, 5, 5), "O": (2, 5, 5, 5, 2),
    "P": (6, 5, 6, 4, 4), "Q": (2, 5, 5, 6, 3), "R": (6, 5, 6, 5, 5), "S": (3, 4, 2, 1, 6), "T": (7, 2, 2, 2, 2),
    "U": (5, 5, 5, 5, 7), "V": (5, 5, 5, 5, 2), "W": (5, 5, 7, 7, 5), "X": (5, 5, 2, 5, 5), "Y": (5, 5, 2, 2, 2),
    "Z": (7, 1, 2, 4, 7), "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (6, 1, 2, 4, 7), "3": (6, 1, 2, 1, 6),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 6, 1, 6), "6": (3, 4, 7, 5, 7), "7": (7, 1, 2, 2, 2), "8": (7, 5, 7, 5, 7),
    "9": (7, 5, 7, 1, 6), ".": (0, 0, 0, 0, 2), ",": (0, 0, 0, 2, 4), "-": (0, 0, 7, 0, 0), "=": (0, 7, 0, 7, 0),
    "(": (1, 2, 2, 2, 1), ")": (4, 2, 2, 2, 4), "/": (1, 1, 2, 4, 4), "<": (1, 2, 4, 2, 1), ">": (4, 2, 1, 2, 4),
    ":": (0, 2, 0, 2, 0), "+": (0, 2, 7, 2, 0), " ": (0, 0, 0, 0, 0),
}  # fmt: skip
COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
          (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]  # fmt: skip
SCALE = 2  # font pixels per glyph pixel


def _text(img: np.ndarray, x: int, y: int, text: str, color=(0, 0, 0)) -> None:
    for ch in text.upper():
        rows = GLYPHS.get(ch, GLYPHS[" "])
        for r, bits in enumerate(rows):
            for c in range(3):
                if bits >> (2 - c) & 1:
                    y0, x0 = y + r * SCALE, x + c * SCALE
                    img[y0 : y0 + SCALE, x0 : x0 + SCALE] = color
        x += 4 * SCALE


def _line(img: np.ndarray, p0, p1, color, width: int = 2, dash: int = 0) -> None:
    (x0, y0), (x1, y1) = p0, p1
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    for i, t in enumerate(np.linspace(0.0, 1.0, n)):
        if dash and (i // dash) % 2:
            continue
        x, y = round(x0 + t * (x1 - x0)), round(y0 + t * (y1 - y0))
        img[max(y - width // 2, 0) : y + (width + 1) // 2, max(x - width // 2, 0) : x + (width + 1) // 2] = color


def _write_png(path: Path, img: np.ndarray) -> None:
    height, width, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)


def line_chart(path: Path, title: str, x_labels: list[str], series: dict[str, list[float]], y_label: str,
               x_label: str = "BATCH SIZE") -> None:  # fmt: skip
    """Write the chart to ``path``: one line per entry of ``series`` (a value per x label)."""
    width, height = 900, 520
    left, right, top, bottom = 70, 250, 50, 60
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    values = [v for vs in series.values() for v in vs] + [1.0]
    lo, hi = min(values), max(values)
    pad = 0.05 * (hi - lo or 1.0)
    lo, hi = lo - pad, hi + pad

    def to_px(i: int, v: float) -> tuple[int, int]:
        x = left + (width - left - right) * (i / max(len(x_labels) - 1, 1))
        y = top + (height - top - bottom) * (1 - (v - lo) / (hi - lo))
        return round(x), round(y)

    plot_bottom, plot_right = height - bottom, width - right
    _line(img, (left, top), (left, plot_bottom), (0, 0, 0), 1)
    _line(img, (left, plot_bottom), (plot_right, plot_bottom), (0, 0, 0), 1)
    for k in range(6):  # y ticks
        v = lo + (hi - lo) * k / 5
        _, y = to_px(0, v)
        _line(img, (left - 4, y), (left, y), (0, 0, 0), 1)
        _line(img, (left + 1, y), (plot_right, y), (225, 225, 225), 1)
        _text(img, 8, y - 5, f"{v:.2f}")
    for i, label in enumerate(x_labels):
        x, _ = to_px(i, lo)
        _line(img, (x, plot_bottom), (x, plot_bottom + 4), (0, 0, 0), 1)
        _text(img, x - 4 * len(label), plot_bottom + 10, label)
    _line(img, to_px(0, 1.0), to_px(len(x_labels) - 1, 1.0), (0, 0, 0), 1, dash=6)
    for n, (name, vs) in enumerate(series.items()):
        color = COLORS[n % len(COLORS)]
        points = [to_px(i, v) for i, v in enumerate(vs)]
        for a, b in zip(points, points[1:]):
            _line(img, a, b, color, 2)
        for x, y in points:
            img[y - 3 : y + 4, x - 3 : x + 4] = color
        ly = top + 10 + 22 * n
        img[ly : ly + 10, plot_right + 15 : plot_right + 35] = color
        _text(img, plot_right + 42, ly, name)
    _text(img, left, 15, title)
    _text(img, left + (plot_right - left) // 2 - 4 * len(x_label), height - 25, x_label)
    _text(img, 8, top - 25, y_label)
    _write_png(path, img)
