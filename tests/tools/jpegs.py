"""JPEGs that a decoder may reject: progressive, CMYK (Adobe), 12 bits per sample, corrupt.

OpenCV writes progressive JPEGs, Pillow CMYK ones; neither writes 12-bit JPEGs, so
:func:`twelve_bit` builds one by hand (extended sequential, one grey component, DC only).
"""

from __future__ import annotations

import io
import struct

import cv2
import numpy as np


def baseline(bgr: np.ndarray, quality: int = 92) -> bytes:
    ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, quality])
    assert ok
    return buf.tobytes()


def progressive(bgr: np.ndarray, quality: int = 92) -> bytes:
    ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1,
                                         cv2.IMWRITE_JPEG_QUALITY, quality])
    assert ok
    return buf.tobytes()


def cmyk(bgr: np.ndarray, quality: int = 92) -> bytes:
    """A 4-component (CMYK, Adobe APP14) JPEG of the picture, as Pillow writes it."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(bgr[:, :, ::-1])).convert("CMYK").save(
        out, "JPEG", quality=quality)
    return out.getvalue()


def _segment(marker: int, payload: bytes) -> bytes:
    return b"\xff" + bytes([marker]) + struct.pack(">H", len(payload) + 2) + payload


def twelve_bit(width: int = 16, height: int = 16, level: int = 2148) -> bytes:
    """A valid 12-bit JPEG (SOF1, precision 12) of one flat grey ``level`` (0..4095); its sides
    are multiples of 8, and ``level`` gives a DC coefficient of 512..1023 (category 10)."""
    assert width % 8 == 0 and height % 8 == 0
    dc = 8 * (level - 2048)  # level shift, then the DCT's DC of a flat 8x8 block
    assert 512 <= dc < 1024
    dqt = _segment(0xDB, bytes([0x00]) + bytes([1] * 64))
    sof = _segment(0xC1, bytes([12]) + struct.pack(">HH", height, width) + bytes([1, 1, 0x11, 0]))
    # DC table: two 2-bit codes, 00 -> category 0 and 01 -> category 10; AC table: 0 -> EOB
    dht_dc = _segment(0xC4, bytes([0x00]) + bytes([0, 2] + [0] * 14) + bytes([0, 10]))
    dht_ac = _segment(0xC4, bytes([0x10]) + bytes([1] + [0] * 15) + bytes([0x00]))
    sos = _segment(0xDA, bytes([1, 1, 0x00, 0, 63, 0]))
    blocks = (width // 8) * (height // 8)
    bits = "01" + format(dc, "010b") + "0" + "000" * (blocks - 1)
    bits += "1" * (-len(bits) % 8)
    scan = bytearray()
    for i in range(0, len(bits), 8):
        scan.append(int(bits[i:i + 8], 2))
        if scan[-1] == 0xFF:
            scan.append(0)  # byte stuffing
    return b"\xff\xd8" + dqt + sof + dht_dc + dht_ac + sos + bytes(scan) + b"\xff\xd9"


def corrupt(bgr: np.ndarray) -> bytes:
    """A JPEG whose frame header has a zero sampling factor: libjpeg and nvJPEG both refuse it."""
    ok, buf = cv2.imencode(".jpg", bgr)
    assert ok
    b = bytearray(buf.tobytes())
    i = 2
    while b[i + 1] != 0xC0:
        i += 2 + int.from_bytes(b[i + 2:i + 4], "big")
    b[i + 11] = 0
    return bytes(b)


def scene(h: int, w: int) -> np.ndarray:
    """A smooth BGR picture (gradients and a disc): JPEG keeps it within a level or two."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.dstack([x * 255 / (w - 1), y * 255 / (h - 1), 128 + 60 * np.sin(x / 9 + y / 13)])
    img[(y - h / 2) ** 2 + (x - w / 3) ** 2 < (h / 5) ** 2] = (30, 200, 60)
    return img.astype(np.uint8)


#: the kinds of :func:`odd_frame`, and those a decoder must decode (the others fail alone)
KINDS = ("progressive", "cmyk", "12-bit", "corrupt")
DECODABLE = ("progressive", "cmyk")


def odd_frame(kind: str, bgr: np.ndarray):
    """A frame of that kind. A 12-bit JPEG is refused by the header check at the door
    (``imaging.encoded_frame``); this one is made past it, as if it had reached a decoder."""
    from visionserve import imaging

    if kind == "12-bit":
        return imaging.Frame("jpeg", twelve_bit(), 16, 16)
    maker = {"progressive": progressive, "cmyk": cmyk, "corrupt": corrupt}[kind]
    return imaging.encoded_frame(maker(bgr))


def check_odd_jpeg_in_a_batch(prep, kind: str) -> dict:
    """Three good JPEGs and one of ``kind`` at index 2 through ``prep`` (a TorchPreprocessor for
    ``prep.spec`` with mean 0, std 1), against the CPU path (:func:`imaging.prepare_batch`): the
    same frames pass, a decodable kind passes with the CPU path's pixels (within a level on
    average: two JPEG decoders, area resize), the others fail alone with 400. Returns
    ``prep.counts`` (which decoder took what)."""
    from visionserve import imaging
    from visionserve.errors import InvalidInput, http_status

    picture = scene(120, 160)
    good = imaging.encoded_frame(baseline(picture))
    frames = [good, good, odd_frame(kind, scene(96, 128)), good]
    t, ok, bad = prep.prepare(frames, 4)
    ref, ref_ok, ref_bad = imaging.prepare_batch(frames, prep.spec, 4)
    assert ok == ref_ok and [i for i, _ in bad] == [i for i, _ in ref_bad]
    if kind in DECODABLE:
        assert ok == [0, 1, 2, 3] and not bad, bad
    else:
        assert ok == [0, 1, 3] and [i for i, _ in bad] == [2]
        assert isinstance(bad[0][1], InvalidInput) and http_status(bad[0][1]) == 400, bad[0][1]
    got = t.float().cpu().numpy()[:len(ok)]
    levels = np.abs(got - ref[:len(ok)]) / prep.spec.scale
    assert levels.mean() < 1.0 and levels.max() < 40, (levels.mean(), levels.max())
    return dict(prep.counts)



def with_orientation(jpeg: bytes, orientation: int, endian: str = "<") -> bytes:
    """``jpeg`` with an EXIF APP1 segment (a TIFF header and one IFD holding only the Orientation
    tag, 0x0112) inserted after the start-of-image marker, as a camera or phone writes it: 6
    means "turn 90 degrees clockwise to view". The pixels are left as they are."""
    assert jpeg[:2] == b"\xff\xd8"
    mark = b"II" if endian == "<" else b"MM"
    tiff = (mark + struct.pack(endian + "HI", 42, 8) + struct.pack(endian + "H", 1)
            + struct.pack(endian + "HHIHH", 0x0112, 3, 1, orientation, 0)
            + struct.pack(endian + "I", 0))  # no next IFD
    return jpeg[:2] + _segment(0xE1, b"Exif\x00\x00" + tiff) + jpeg[2:]
