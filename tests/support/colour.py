"""Colour science for the report's page tests: sRGB hex to CIELAB, CIEDE2000 and a simulation of
colour-vision deficiency, written from the published formulas (independent of partc).

- sRGB to XYZ (D65) and XYZ to CIELAB: IEC 61966-2-1 and CIE 15.
- CIEDE2000: G. Sharma, W. Wu, E. N. Dalal, "The CIEDE2000 color-difference formula:
  implementation notes, supplementary test data, and mathematical observations", Color Research
  and Application 30 (2005); `tests/test_report_pages.py` checks it against their test pairs.
- Dichromacy: G. M. Machado, M. M. Oliveira, L. A. F. Fernandes, "A physiologically-based model
  for simulation of color vision deficiency", IEEE TVCG 15 (2009), severity 1.0 matrices,
  applied to linear RGB.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Lab = tuple[float, float, float]
"""A CIELAB colour (L*, a*, b*), D65 white."""

DICHROMACY = {
    "protanopia": ((0.152286, 1.052583, -0.204868), (0.114503, 0.786281, 0.099216),
                   (-0.003882, -0.048116, 1.051998)),
    "deuteranopia": ((0.367322, 0.860646, -0.227968), (0.280085, 0.672501, 0.047413),
                     (-0.011820, 0.042940, 0.968881)),
    "tritanopia": ((1.255528, -0.076749, -0.178779), (-0.078411, 0.930809, 0.147602),
                   (0.004733, 0.691367, 0.303900)),
}
"""Machado et al.'s severity-1.0 matrices on linear RGB, by deficiency."""


def _linear(channel: float) -> float:
    return channel / 12.92 if channel <= 0.04045 else ((channel + 0.055) / 1.055) ** 2.4


def linear_rgb(colour: str) -> tuple[float, float, float]:
    """`#rrggbb` (or `rgb(r, g, b)` as a browser reports it) as linear-light RGB in [0, 1]."""
    text = colour.strip()
    if text.startswith("rgb"):
        parts = [float(p) / 255 for p in text[text.index("(") + 1:text.index(")")].split(",")]
    else:
        parts = [int(text[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    red, green, blue = (_linear(p) for p in parts[:3])
    return red, green, blue


def lab_of_linear(rgb: Sequence[float]) -> Lab:
    """CIELAB of a linear-light sRGB colour (channels clipped to [0, 1])."""
    r, g, b = (min(1.0, max(0.0, c)) for c in rgb)
    x = (0.4124564 * r + 0.3575761 * g + 0.1804375 * b) / 0.95047
    y = 0.2126729 * r + 0.7151522 * g + 0.0721750 * b
    z = (0.0193339 * r + 0.1191920 * g + 0.9503041 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > (6 / 29) ** 3 else t / (3 * (6 / 29) ** 2) + 4 / 29

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def lab(colour: str, deficiency: str | None = None) -> Lab:
    """CIELAB of a colour as seen with normal vision or with a `DICHROMACY`."""
    rgb = linear_rgb(colour)
    if deficiency is not None:
        rgb = tuple(sum(m * c for m, c in zip(row, rgb, strict=True))  # type: ignore[assignment]
                    for row in DICHROMACY[deficiency])
    return lab_of_linear(rgb)


def ciede2000(first: Lab, second: Lab) -> float:
    """The CIEDE2000 colour difference of two CIELAB colours (kL = kC = kH = 1)."""
    l1, a1, b1 = first
    l2, a2, b2 = second
    c_mean = (math.hypot(a1, b1) + math.hypot(a2, b2)) / 2
    g = 0.5 * (1 - math.sqrt(c_mean ** 7 / (c_mean ** 7 + 25 ** 7)))
    a1p, a2p = (1 + g) * a1, (1 + g) * a2
    c1p, c2p = math.hypot(a1p, b1), math.hypot(a2p, b2)
    h1p = math.degrees(math.atan2(b1, a1p)) % 360 if c1p else 0.0
    h2p = math.degrees(math.atan2(b2, a2p)) % 360 if c2p else 0.0
    dl, dc = l2 - l1, c2p - c1p
    if c1p * c2p == 0:
        dh = 0.0
    elif abs(h2p - h1p) <= 180:
        dh = h2p - h1p
    else:
        dh = h2p - h1p - 360 if h2p > h1p else h2p - h1p + 360
    big_dh = 2 * math.sqrt(c1p * c2p) * math.sin(math.radians(dh / 2))
    l_mean, cp_mean = (l1 + l2) / 2, (c1p + c2p) / 2
    if c1p * c2p == 0:
        h_mean = h1p + h2p
    elif abs(h1p - h2p) <= 180:
        h_mean = (h1p + h2p) / 2
    else:
        h_mean = (h1p + h2p + 360) / 2 if h1p + h2p < 360 else (h1p + h2p - 360) / 2
    t = (1 - 0.17 * math.cos(math.radians(h_mean - 30)) + 0.24 * math.cos(math.radians(2 * h_mean))
         + 0.32 * math.cos(math.radians(3 * h_mean + 6))
         - 0.20 * math.cos(math.radians(4 * h_mean - 63)))
    s_l = 1 + 0.015 * (l_mean - 50) ** 2 / math.sqrt(20 + (l_mean - 50) ** 2)
    s_c = 1 + 0.045 * cp_mean
    s_h = 1 + 0.015 * cp_mean * t
    r_t = (-2 * math.sqrt(cp_mean ** 7 / (cp_mean ** 7 + 25 ** 7))
           * math.sin(math.radians(60 * math.exp(-(((h_mean - 275) / 25) ** 2)))))
    return math.sqrt((dl / s_l) ** 2 + (dc / s_c) ** 2 + (big_dh / s_h) ** 2
                     + r_t * (dc / s_c) * (big_dh / s_h))


def closest_pair(colours: Sequence[str], deficiency: str | None = None
                 ) -> tuple[float, str, str]:
    """The smallest CIEDE2000 difference between two of `colours` (as seen with `deficiency`)
    and the pair that has it."""
    labs = [lab(c, deficiency) for c in colours]
    return min((ciede2000(labs[i], labs[j]), colours[i], colours[j])
               for i in range(len(colours)) for j in range(i + 1, len(colours)))
