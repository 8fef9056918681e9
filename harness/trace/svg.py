"""A small hand-written SVG canvas shared by the trace pictures (``render.py``, ``plot.py``).

No dependency: elements are strings. Every text element records the extent it needs,
from a conservative width per character of the monospace font, so the picture's size
is computed from what it holds and no label is clipped.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

FONT_SIZE = 11
# Advance width of one monospace character, in em. DejaVu Sans Mono, Menlo and Courier
# advance 0.60 em; 0.65 leaves room for any monospace fallback a viewer picks.
CHAR_EM = 0.65
MARGIN = 10
RED, INK, GREY = "#c00", "#335", "#888"

# A string, or a function of the final right edge and height (a band across the picture).
Element = str | Callable[[float, float], str]


def text_width(text: str, size: float = FONT_SIZE) -> float:
    """A conservative width of ``text`` in the monospace font at ``size`` px."""
    return len(text) * size * CHAR_EM


def wrap(text: str, width_px: float, size: float = FONT_SIZE) -> list[str]:
    """``text`` in lines no wider than ``width_px`` (at least 40 characters a line)."""
    chars = max(40, int(width_px / (size * CHAR_EM)))
    return textwrap.wrap(text, chars, break_on_hyphens=False) or [""]


@dataclass
class Canvas:
    """SVG elements and the extent they need. The size is known only at the end, so an
    element may be a function of the final right edge and height (a band across the
    picture). A label placed left of 0 moves the viewBox's origin: it is never clipped."""

    right: float = 0.0
    bottom: float = 0.0
    left: float = 0.0  # below 0 only if a label was placed too far left: still drawn
    items: list[Element] = field(default_factory=list)

    def extend_to(self, right: float, bottom: float, left: float = 0.0) -> None:
        self.right = max(self.right, right)
        self.bottom = max(self.bottom, bottom)
        self.left = min(self.left, left)

    def text(self, x: float, y: float, text: str, size: float = FONT_SIZE,
             anchor: str = "start", attrs: str = "") -> None:
        """A text element with its baseline at ``y``; ``attrs`` are extra attributes."""
        width = text_width(text, size)
        left = {"start": x, "middle": x - width / 2, "end": x - width}[anchor]
        self.extend_to(left + width, y + 0.3 * size, left)
        size_attr = "" if size == FONT_SIZE else f' font-size="{size:g}"'
        anchor_attr = "" if anchor == "start" else f' text-anchor="{anchor}"'
        self.items.append(f'<text x="{x:.1f}" y="{y:.1f}"{size_attr}{anchor_attr}{attrs}>'
                          f"{escape(text)}</text>")

    def add(self, element: Element, right: float = 0.0, bottom: float = 0.0) -> None:
        self.extend_to(right, bottom)
        self.items.append(element)

    def to_svg(self, defs: str = "") -> str:
        x0 = 0 if self.left >= 0 else math.floor(self.left) - MARGIN
        width, height = int(self.right + MARGIN + 1) - x0, int(self.bottom + MARGIN + 1)
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
               f'viewBox="{x0} 0 {width} {height}" font-family="monospace" '
               f'font-size="{FONT_SIZE}">']
        if defs:
            out.append(f"<defs>{defs}</defs>")
        out.append(f'<rect x="{x0}" width="{width}" height="{height}" fill="white"/>')
        out.extend(item if isinstance(item, str) else item(x0 + width, height)
                   for item in self.items)
        out.append("</svg>")
        return "\n".join(out) + "\n"


def arrow_marker(name: str, colour: str) -> str:
    """A ``<marker>`` arrowhead for ``marker-end="url(#name)"``."""
    return (f'<marker id="{name}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
            f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
            f'fill="{colour}"/></marker>')
