"""Cameras as sources of the server itself (docs/cameras.md).

A camera is a :class:`~visionserve.cameras.source.Source` with a name, opened from a URI by its
scheme (``folder:PATH``, ``gige://DEVICE``, ``rtsp://...``): ``source.py`` declares the
interface and the registry of schemes, each scheme's module implements it (``folder.py``,
``gige.py``, ...), ``pixels.py`` turns what a camera sends into the RGB pixels of a raw frame,
and ``service.py`` owns the cameras (one thread each: open, grab, reconnect) and turns a trigger
into frames submitted through the data plane, like an inspect request.
"""
