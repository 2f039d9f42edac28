"""An RTSP camera for the rtsp:// tests: GStreamer's RTSP server (``gir1.2-gst-rtsp-server-1.0``
through PyGObject) serving one H.264 stream at ``rtsp://HOST:PORT/test``.

    python tests/tools/rtsp_server.py --port 8554 [--user U --password P] [--fps 30]
    python tests/tools/rtsp_server.py --check    # says what is missing, exit 1, if anything

Each frame (640x480, I420) carries the server's wall-clock time when it was made, in
milliseconds, as a bar code of :data:`BITS` white (1) or black (0) blocks along its top
(:func:`stamp_of` reads it back), and a grey square that moves with every frame below it; it is
time-stamped by the pipeline's clock as it is pushed, so frames leave at the rate they are made
(``--fps``). With ``--user``/``--password`` the server asks for them (HTTP Basic, or Digest with
``--digest``). It prints
``ready`` once it listens, and serves until killed.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np

WIDTH, HEIGHT = 640, 480
#: the stamp's bits (milliseconds since the epoch fit in 42), each a block BLOCK_W x BLOCK_H
BITS, BLOCK_W, BLOCK_H = 42, 15, 32
SQUARE = 64


def stamp_of(rgb: np.ndarray) -> float:
    """The wall-clock time (s) a frame of this server was made, read from its bar code (an HxWx3
    or HxW image as decoded by the client)."""
    grey = rgb.mean(axis=2) if rgb.ndim == 3 else rgb
    ms = 0
    for bit in range(BITS):
        block = grey[8:BLOCK_H - 8, bit * BLOCK_W + 4:(bit + 1) * BLOCK_W - 4]
        ms = ms << 1 | int(block.mean() > 128)
    return ms / 1000


def frame(n: int, now: float) -> bytes:
    """Frame ``n``, made at ``now``, as I420 bytes."""
    y = np.full((HEIGHT, WIDTH), 16, np.uint8)
    ms = int(now * 1000)
    for bit in range(BITS):
        if ms >> (BITS - 1 - bit) & 1:
            y[:BLOCK_H, bit * BLOCK_W:(bit + 1) * BLOCK_W] = 235
    x = (n * 8) % (WIDTH - SQUARE)
    top = BLOCK_H + 16 + (n * 5) % (HEIGHT - BLOCK_H - 16 - SQUARE)
    y[top:top + SQUARE, x:x + SQUARE] = 160
    chroma = np.full(WIDTH * HEIGHT // 2, 128, np.uint8)
    return y.tobytes() + chroma.tobytes()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int)
    ap.add_argument("--check", action="store_true", help="only check that it can serve here")
    ap.add_argument("--user")
    ap.add_argument("--password")
    ap.add_argument("--digest", action="store_true", help="Digest authentication, not Basic")
    ap.add_argument("--fps", type=int, default=30)
    args = ap.parse_args()

    try:
        import gi

        gi.require_version("Gst", "1.0")
        gi.require_version("GstRtsp", "1.0")
        gi.require_version("GstRtspServer", "1.0")
        from gi.repository import GLib, Gst, GstRtsp, GstRtspServer
    except (ImportError, ValueError) as exc:
        print(f"GStreamer's RTSP server bindings are missing ({exc})", file=sys.stderr)
        return 1
    Gst.init(None)
    missing = [e for e in ("appsrc", "videoconvert", "x264enc", "rtph264pay")
               if Gst.ElementFactory.find(e) is None]
    if missing:
        print(f"GStreamer elements missing: {', '.join(missing)}", file=sys.stderr)
        return 1
    if args.check:
        return 0
    if args.port is None:
        ap.error("--port is required")
    launch = (f"( appsrc name=src is-live=true do-timestamp=true format=time "
              f"caps=video/x-raw,format=I420,width={WIDTH},height={HEIGHT},"
              f"framerate={args.fps}/1 ! videoconvert ! x264enc tune=zerolatency "
              f"speed-preset=ultrafast key-int-max=15 ! rtph264pay name=pay0 pt=96 )")
    factory = GstRtspServer.RTSPMediaFactory()
    factory.set_launch(launch)
    factory.set_shared(True)
    current: list = [None]  # the appsrc of the media being served, if any

    def configured(_factory, media) -> None:
        current[0] = media.get_element().get_by_name("src")
        media.connect("unprepared", lambda _m: current.__setitem__(0, None))

    factory.connect("media-configure", configured)

    server = GstRtspServer.RTSPServer()
    server.set_address(args.host)
    server.set_service(str(args.port))
    if args.user is not None:
        auth = GstRtspServer.RTSPAuth()
        token = GstRtspServer.RTSPToken()
        token.set_string(GstRtspServer.RTSP_TOKEN_MEDIA_FACTORY_ROLE, "camera-user")
        if args.digest:
            auth.add_digest(args.user, args.password or "", token)
            auth.set_supported_methods(GstRtsp.RTSPAuthMethod.DIGEST)
        else:
            auth.add_basic(GstRtspServer.RTSPAuth.make_basic(args.user, args.password or ""),
                           token)
        server.set_auth(auth)
        role = Gst.Structure.from_string("camera-user, media.factory.access=(boolean)true, "
                                         "media.factory.construct=(boolean)true")[0]
        factory.add_role_from_structure(role)
    server.get_mount_points().add_factory("/test", factory)
    if server.attach(None) == 0:
        print(f"cannot listen on {args.host}:{args.port}", file=sys.stderr)
        return 1

    def push() -> None:
        n = 0
        period = 1.0 / args.fps
        next_at = time.monotonic()
        while True:
            next_at += period
            time.sleep(max(0.0, next_at - time.monotonic()))
            src = current[0]
            if src is None:
                continue
            src.emit("push-buffer", Gst.Buffer.new_wrapped(frame(n, time.time())))
            n += 1

    threading.Thread(target=push, daemon=True).start()
    print("ready", flush=True)
    GLib.MainLoop().run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
