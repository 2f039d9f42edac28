"""Bayer mosaics demosaiced with torch on the tensor's device: the GPU path's half of the
demosaic, equal bit for bit to the CPU path's OpenCV (:func:`visionserve.imaging.demosaic`;
docs/cameras.md, "Pixel formats"). A camera's Bayer frame crosses to the device as its 8-bit
mosaic (a third of the RGB bytes) and is demosaiced there by the preprocessor
(:mod:`.preprocess`), or by ``cameras.pixels.to_rgb8_device``.
"""

from __future__ import annotations

from typing import Any


def demosaic_bilinear(mosaic: Any, pattern: str) -> Any:
    """A uint8 ``HxW`` Bayer mosaic (GenICam ``pattern``: "RG", "GB", "GR" or "BG") -> ``HxWx3``
    uint8 RGB on its device, as OpenCV's ``COLOR_Bayer*2RGB``: a missing colour is the mean of
    its 2 (edge-adjacent, along the row or the column) or 4 (edge- or corner-adjacent) nearest
    samples of that colour, rounded half up in integers; the border rows and columns repeat
    their neighbours inside."""
    import torch

    h, w = int(mosaic.shape[0]), int(mosaic.shape[1])
    x = mosaic.to(torch.int32)
    c = x[1:-1, 1:-1]
    north, south, west, east = x[:-2, 1:-1], x[2:, 1:-1], x[1:-1, :-2], x[1:-1, 2:]
    cross = (north + south + west + east + 2) >> 2
    diag = (x[:-2, :-2] + x[:-2, 2:] + x[2:, :-2] + x[2:, 2:] + 2) >> 2
    horiz = (west + east + 1) >> 1
    vert = (north + south + 1) >> 1
    # the red sample's row and column parity; blue sits on the other parity of both
    red_y, red_x = {"RG": (0, 0), "GR": (0, 1), "GB": (1, 0), "BG": (1, 1)}[pattern]
    ys = (torch.arange(1, h - 1, device=x.device) % 2 == red_y).unsqueeze(1)  # a red row
    xs = (torch.arange(1, w - 1, device=x.device) % 2 == red_x).unsqueeze(0)  # a red column
    red = ys & xs
    blue = ~ys & ~xs
    green_red_row = ys & ~xs
    r = torch.where(red, c, torch.where(blue, diag, torch.where(green_red_row, horiz, vert)))
    g = torch.where(red | blue, cross, c)
    b = torch.where(blue, c, torch.where(red, diag, torch.where(green_red_row, vert, horiz)))
    out = torch.empty((h, w, 3), dtype=torch.uint8, device=x.device)
    out[1:-1, 1:-1] = torch.stack((r, g, b), dim=-1).to(torch.uint8)
    out[1:-1, 0] = out[1:-1, 1]
    out[1:-1, -1] = out[1:-1, -2]
    out[0] = out[1]
    out[-1] = out[-2]
    return out
